"""Choosing and building the attention backend: `--attention-backend torch_native|triton|flashinfer`.

Per-device default: CUDA takes flashinfer when it imports, else triton; CPU takes
torch_native. Asking for a backend the device cannot run is an error that says
what to pick instead.
"""
from __future__ import annotations

from typing import Optional

import torch

from workbench.core.layers.attention.base_attn_backend import AttentionBackend

ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")


def unavailable_reason(name: str, device: str, dtype=None) -> Optional[str]:
    """None when backend `name` can run on `device` ("cpu" / "cuda") with `dtype` (a torch.dtype or a
    --dtype name; None: any), else why not and what to do."""
    if name == "torch_native":
        return None
    if name == "triton":
        from workbench.core.layers.attention.triton_backend import triton_unavailable_reason
        return triton_unavailable_reason(device)
    if name == "flashinfer":
        from workbench.core.layers.attention.flashinfer_backend import flashinfer_unavailable_reason
        return flashinfer_unavailable_reason(device, dtype)
    return f"unknown attention backend {name!r}; pick one of {', '.join(ATTENTION_BACKENDS)}"


def default_attention_backend(device: str, dtype=None) -> str:
    """flashinfer (else triton, else torch_native) on CUDA; torch_native on CPU. A float32 model
    skips flashinfer, whose kernels are 16-bit only."""
    if device == "cuda":
        for name in ("flashinfer", "triton"):
            if unavailable_reason(name, device, dtype) is None:
                return name
    return "torch_native"


def create_attn_backend(name: str, device: str, num_q_heads: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, kv_dtype: torch.dtype) -> AttentionBackend:
    """Build backend `name` for one rank's heads; raises ValueError when `device` cannot run it."""
    reason = unavailable_reason(name, device, dtype)
    if reason:
        raise ValueError(reason)
    if name == "torch_native":
        from workbench.core.layers.attention.torch_native_backend import TorchNativeAttnBackend
        return TorchNativeAttnBackend()
    if name == "triton":
        from workbench.core.layers.attention.triton_backend import TritonAttnBackend
        return TritonAttnBackend(num_q_heads, head_dim, device)
    from workbench.core.layers.attention.flashinfer_backend import FlashInferAttnBackend
    return FlashInferAttnBackend(num_q_heads, num_kv_heads, head_dim, head_dim ** -0.5, dtype, kv_dtype, device)
