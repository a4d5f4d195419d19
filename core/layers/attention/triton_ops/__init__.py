"""Triton kernels for attention over the token-slot KV pool (decode and extend).

Importing this package imports triton; callers guard the import (see
`triton_backend.triton_available`).
"""

from workbench.core.layers.attention.triton_ops.decode_attention import decode_attention_fwd
from workbench.core.layers.attention.triton_ops.extend_attention import extend_attention_fwd

__all__ = ["decode_attention_fwd", "extend_attention_fwd"]
