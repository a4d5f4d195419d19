"""Choosing and building the attention backend: `--attention-backend cpu_paged|torch_native|triton|flashinfer`.

Per-device default: CUDA takes flashinfer when it imports, else triton; CPU takes
cpu_paged when its kernels build (a C compiler is needed), else torch_native. Asking
for a backend the device cannot run is an error that says what to pick instead.
"""

from __future__ import annotations

import torch
from workbench.core.args import ATTENTION_BACKENDS
from workbench.core.layers.attention.base_attn_backend import AttentionBackend


def unavailable_reason(name: str, device: str, dtype=None) -> str | None:
    """None when backend `name` can run on `device` ("cpu" / "cuda") with `dtype` (a torch.dtype or a
    --dtype name; None: any), else why not and what to do."""
    if name == "torch_native":
        return None
    if name == "cpu_paged":
        from workbench.core.layers.attention.cpu_paged_backend import cpu_paged_unavailable_reason

        return cpu_paged_unavailable_reason(device, _as_torch_dtype(dtype))
    if name == "triton":
        from workbench.core.layers.attention.triton_backend import triton_unavailable_reason

        return triton_unavailable_reason(device)
    if name == "flashinfer":
        from workbench.core.layers.attention.flashinfer_backend import flashinfer_unavailable_reason

        return flashinfer_unavailable_reason(device, dtype)
    return f"unknown attention backend {name!r}; pick one of {', '.join(ATTENTION_BACKENDS)}"


def default_attention_backend(device: str, dtype=None) -> str:
    """flashinfer (else triton, else torch_native) on CUDA; cpu_paged (else torch_native) on CPU.
    A float32 model skips flashinfer, whose kernels are 16-bit only."""
    for name in ("flashinfer", "triton") if device == "cuda" else ("cpu_paged",):
        if unavailable_reason(name, device, dtype) is None:
            return name
    return "torch_native"


def choose_attention_backend(
    requested: str | None, device: str, dtype, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> str:
    """`requested` if given, else the device default, stepping down from cpu_paged to torch_native
    for head shapes its kernel does not handle (a request for cpu_paged itself is not changed)."""
    if requested:
        return requested
    name = default_attention_backend(device, dtype)
    if name == "cpu_paged":
        from workbench.core.layers import cpu_ops

        if cpu_ops.shape_unsupported_reason(num_q_heads, num_kv_heads, head_dim):
            return "torch_native"
    return name


def _as_torch_dtype(dtype):
    """A torch.dtype for a --dtype name ("auto" and None stay None: any)."""
    if isinstance(dtype, str):
        return getattr(torch, dtype, None) if dtype != "auto" else None
    return dtype


def create_attn_backend(
    name: str,
    device: str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> AttentionBackend:
    """Build backend `name` for one rank's heads; raises ValueError when `device` cannot run it."""
    reason = unavailable_reason(name, device, dtype)
    if reason:
        raise ValueError(reason)
    if name == "torch_native":
        from workbench.core.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return TorchNativeAttnBackend()
    if name == "cpu_paged":
        from workbench.core.layers import cpu_ops
        from workbench.core.layers.attention.cpu_paged_backend import CpuPagedAttnBackend

        shape = cpu_ops.shape_unsupported_reason(num_q_heads, num_kv_heads, head_dim)
        if shape:
            raise ValueError(
                f"the cpu_paged attention backend cannot run this model: {shape}; use --attention-backend torch_native"
            )
        return CpuPagedAttnBackend(group_size=num_q_heads // max(1, num_kv_heads))
    if name == "triton":
        from workbench.core.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(num_q_heads, head_dim, device)
    from workbench.core.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(num_q_heads, num_kv_heads, head_dim, head_dim**-0.5, dtype, kv_dtype, device)
