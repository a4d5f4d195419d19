"""Benchmarks: `workbench bench model` (model_bench) and `workbench bench serve` (serve_bench)."""
