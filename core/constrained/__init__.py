"""Constrained decoding: grammars (JSON Schema, regex, EBNF) that mask what a request may sample."""
