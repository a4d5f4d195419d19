"""Speculative decoding: draft tokens proposed cheaply, verified by the target model in one pass."""
