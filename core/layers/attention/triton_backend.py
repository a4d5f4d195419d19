"""Attention with Triton kernels over the token-slot KV pool (the CUDA default without flashinfer).

Decode: split-KV kernel with a reduction stage (`triton_ops.decode_attention`),
reading each request's slots straight from `req_to_token` — so its only per-pass
metadata are two float32 scratch buffers, and a CUDA graph needs nothing refreshed
at replay beyond the input buffers the graph runner already fills.
Extend: prefix from the pool plus the pass's new tokens, causal
(`triton_ops.extend_attention`).

On CPU the kernels run only under Triton's interpreter (`TRITON_INTERPRET=1`, set
before triton is imported): that is how the tests check them against torch_native.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from workbench.core.layers.attention.base_attn_backend import AttentionBackend

# Splits of the KV sequence per (request, KV head) in decode. More splits keep a GPU busy at small
# batch; on the CPU interpreter each split is a Python-level program, so fewer is kinder there.
DEFAULT_NUM_KV_SPLITS = {"cuda": 8, "cpu": 2}


# Triton's interpreter before 3.7 hands scalar loads back as 1-element arrays, which `range()` over a
# runtime bound rejects; compiled for a GPU the same kernels run on 3.6 (checked on an H100).
MIN_INTERPRETER_TRITON = (3, 7)


def triton_interpreter_unsupported_reason() -> str | None:
    """None when the installed triton's interpreter (TRITON_INTERPRET=1) runs these kernels, else why not.

    Reads the version from package metadata: importing triton here would fix TRITON_INTERPRET
    for the whole process before a caller sets it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("triton")
    except PackageNotFoundError:
        return "triton is not installed (pip install triton)"
    parts = tuple(int(x) for x in v.split("+")[0].split(".")[:2] if x.isdigit())
    if parts < MIN_INTERPRETER_TRITON:
        return (
            f"triton {v}'s interpreter cannot run these kernels on CPU (it needs triton >= "
            f"{'.'.join(map(str, MIN_INTERPRETER_TRITON))}; on a GPU {v} is fine)"
        )
    return None


def triton_unavailable_reason(device: str) -> str | None:
    """None when the triton backend can run on `device`, else what to do about it."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return (
            "the triton attention backend needs the `triton` package (pip install triton); "
            "or pick --attention-backend torch_native"
        )
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "triton kernels run on CUDA; on CPU only Triton's interpreter can run them "
            "(TRITON_INTERPRET=1, very slow, for tests) — use --attention-backend torch_native on CPU"
        )
    if device == "cpu":
        reason = triton_interpreter_unsupported_reason()
        if reason:
            return reason + " — use --attention-backend torch_native on CPU"
    if device not in ("cpu", "cuda"):
        return f"the triton attention backend does not run on {device!r}"
    return None


@dataclass
class TritonDecodeMetadata:
    att_out: torch.Tensor  # [B, Hq, splits, D] float32: each split's attention output
    att_lse: torch.Tensor  # [B, Hq, splits] float32: each split's log-sum-exp
    num_kv_splits: int


@dataclass
class TritonExtendMetadata:
    prefix_lens: torch.Tensor  # [B] tokens already in the pool
    extend_seq_lens: torch.Tensor  # [B] new tokens
    extend_start_loc: torch.Tensor  # [B] first row of each request in q/k/v
    max_extend_len: int


class TritonAttnBackend(AttentionBackend):
    """Triton decode (split-KV + reduce) and extend (prefix + causal new tokens) attention."""

    name = "triton"
    cuda_graph_capturable = True
    verify_cuda_graph_capturable = True  # the extend kernel reads every length from device buffers

    def __init__(self, num_q_heads: int, head_dim: int, device: str, num_kv_splits: int | None = None):
        reason = triton_unavailable_reason(torch.device(device).type)
        if reason:
            raise RuntimeError(reason)
        from workbench.core.layers.attention import triton_ops

        self._ops = triton_ops
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.num_kv_splits = num_kv_splits or DEFAULT_NUM_KV_SPLITS.get(self.device.type, 4)
        self._graph_att_out: torch.Tensor | None = None
        self._graph_att_lse: torch.Tensor | None = None

    # ---- metadata ------------------------------------------------------------------------
    def _decode_scratch(self, bs: int) -> TritonDecodeMetadata:
        s = self.num_kv_splits
        return TritonDecodeMetadata(
            torch.empty((bs, self.num_q_heads, s, self.head_dim), dtype=torch.float32, device=self.device),
            torch.empty((bs, self.num_q_heads, s), dtype=torch.float32, device=self.device),
            s,
        )

    def init_forward_metadata(self, fb) -> None:
        if fb.forward_mode.is_decode():
            fb.attn_metadata = self._decode_scratch(fb.batch_size)
            return

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

        fb.attn_metadata = TritonExtendMetadata(
            dev(fb.extend_prefix_lens_cpu),
            dev(fb.extend_seq_lens_cpu),
            dev(fb.extend_start_loc_cpu),
            max(fb.extend_seq_lens_cpu),
        )

    # ---- attention -------------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        meta: TritonExtendMetadata = fb.attn_metadata
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._ops.extend_attention_fwd(
            q,
            k,
            v,
            o,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            meta.prefix_lens,
            meta.extend_seq_lens,
            meta.extend_start_loc,
            meta.max_extend_len,
            layer.scaling,
        )
        return o

    def forward_decode(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        meta: TritonDecodeMetadata = fb.attn_metadata
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._ops.decode_attention_fwd(
            q,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            o,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            meta.att_out,
            meta.att_lse,
            meta.num_kv_splits,
            layer.scaling,
        )
        return o

    # ---- CUDA-graph hooks ----------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        scratch = self._decode_scratch(max_bs)
        self._graph_att_out, self._graph_att_lse = scratch.att_out, scratch.att_lse

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_batch) -> None:
        if self._graph_att_out is None:
            raise RuntimeError("call init_cuda_graph_state before capturing")
        forward_batch.attn_metadata = TritonDecodeMetadata(
            self._graph_att_out[:bs], self._graph_att_lse[:bs], self.num_kv_splits
        )

    def init_forward_metadata_replay_cuda_graph(
        self, bs, req_pool_indices, seq_lens, seq_lens_cpu, forward_batch
    ) -> None:
        # Nothing to refresh: the kernels read rows and lengths from the graph's input buffers.
        pass

    def init_forward_metadata_capture_verify_cuda_graph(self, bs, buffers, forward_batch) -> None:
        # The kernel's grid is sized by the rows per request, fixed for a verify graph; prefix
        # lengths, row counts and first rows are read from the static buffers by address.
        forward_batch.attn_metadata = TritonExtendMetadata(
            buffers.prefix_lens[:bs], buffers.extend_lens[:bs], buffers.extend_start_loc[:bs], buffers.tokens_per_req
        )

    def init_forward_metadata_replay_verify_cuda_graph(self, bs, buffers, forward_batch) -> None:
        pass  # buffers.load() already wrote this batch's prefix lengths
