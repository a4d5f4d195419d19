"""Benchmarks (`workbench bench ...`)."""
