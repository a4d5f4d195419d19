"""`cpu_paged`: attention by compiled kernels that read the KV pool in place — the CPU default.

Decode: the torch-native backend (the reference) gathers each decode batch's K/V
into a padded [B, Hk, L_max, D] copy per layer before SDPA. With mixed context
lengths most of that copy is padding, and it costs more than the attention itself:
measured on the 2-core target at B=32, contexts 17-511 tokens, one layer takes
4.3 ms there and 1.0 ms here (float32, 2 threads; `cpu_ops/paged_attention.c`).
Extend: one call for the whole batch, causal over each request's cached prefix and
new tokens, all read through req_to_token (`cpu_ops/paged_extend.c`); torch's CPU
flash kernel, called per request, was ~30 GFLOP/s on this model's head shapes.
The extend kernel is faster than torch's flash kernel on AVX2 and AVX-512 CPUs (AVX2, znver3:
~6-8 vs ~10-13 ms per layer for a 512-token prompt, one thread); CPUs with neither prefill
through the torch-native path (`cpu_ops.extend_kernel_preferred`).
Decode batches whose requests share a cached prefix (a system prompt) attend over it once per
group (cascade attention, `cpu_ops/prefix_attention.c`); the groups are found once per step.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from workbench.core.layers import cpu_ops
from workbench.core.layers.attention.torch_native_backend import TorchNativeAttnBackend


@dataclass
class PagedDecodeMetadata:
    req_pool_indices: torch.Tensor  # [B] int64, contiguous: each request's row of req_to_token
    seq_lens: torch.Tensor  # [B] int64, contiguous: its context length, this step's token included
    out_cache_loc: torch.Tensor  # [B] int64, contiguous: the slot this step's K/V go to
    groups: cpu_ops.PrefixGroups | None = None  # requests sharing a prefix of slots, if any


def cpu_paged_unavailable_reason(device: str, dtype=None) -> str | None:
    """None when the kernel can serve `device`/`dtype`, else why not and what to pick instead."""
    if device != "cpu":
        return "the cpu_paged attention backend runs on CPU only; on CUDA use flashinfer or triton"
    if isinstance(dtype, torch.dtype) and not cpu_ops.supports(dtype):
        return f"the cpu_paged attention backend has no {dtype} kernel; use --attention-backend torch_native"
    reason = cpu_ops.unavailable_reason()
    if reason:
        return f"{reason}. Use --attention-backend torch_native"
    return None


@dataclass
class PagedExtendMetadata:
    req_pool_indices: torch.Tensor  # [B] int64: each request's row of req_to_token
    prefix_lens: torch.Tensor  # [B] int64: tokens already in the pool before this pass
    extend_lens: torch.Tensor  # [B] int64: new tokens this pass
    extend_starts: torch.Tensor  # [B] int64: each request's first row in the batch's q


class CpuPagedAttnBackend(TorchNativeAttnBackend):
    name = "cpu_paged"

    def __init__(self, group_size: int = 1):
        """group_size: query heads per KV head (sizes the shared-prefix groups worth forming)."""
        super().__init__()
        self.group_size = max(1, group_size)
        # Prefill through torch's SDPA (the parent's path) where the compiled kernel is slower.
        self.use_extend_kernel = cpu_ops.extend_kernel_preferred()

    def init_forward_metadata(self, fb) -> None:
        if fb.forward_mode.is_decode():
            fb.attn_metadata = self._decode_metadata(fb.req_pool_indices, fb.seq_lens, fb)
            return
        if not self.use_extend_kernel:
            super().init_forward_metadata(fb)
            return
        fb.attn_metadata = PagedExtendMetadata(
            fb.req_pool_indices.to(torch.int64).contiguous(),
            torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64),
            torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64),
            torch.tensor(fb.extend_start_loc_cpu, dtype=torch.int64),
        )

    def forward_extend(self, q, k, v, layer, fb) -> torch.Tensor:
        """Store this pass's K/V, then one kernel call attends for every request of the batch."""
        if not self.use_extend_kernel:
            return super().forward_extend(q, k, v, layer, fb)
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        meta: PagedExtendMetadata = fb.attn_metadata
        return cpu_ops.paged_extend_attention(
            q,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            fb.req_to_token_pool.req_to_token,
            meta.req_pool_indices,
            meta.prefix_lens,
            meta.extend_lens,
            meta.extend_starts,
            layer.scaling,
        )

    def forward_decode(self, q, k, v, layer, fb) -> torch.Tensor:
        """One kernel call stores this step's K/V into the pool and attends."""
        pool = fb.token_to_kv_pool
        meta: PagedDecodeMetadata = fb.attn_metadata
        if k.dtype != q.dtype or v.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        return cpu_ops.paged_decode_attention(
            q,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            fb.req_to_token_pool.req_to_token,
            meta.req_pool_indices,
            meta.seq_lens,
            layer.scaling,
            k_new=k,
            v_new=v,
            out_cache_loc=meta.out_cache_loc,
            groups=meta.groups,
        )

    # The CPU stand-in graph re-runs Python at replay, so plain metadata serves it.
    def init_forward_metadata_replay_cuda_graph(
        self, bs, req_pool_indices, seq_lens, seq_lens_cpu, forward_batch
    ) -> None:
        forward_batch.attn_metadata = self._decode_metadata(req_pool_indices, seq_lens, forward_batch)

    def _decode_metadata(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, fb) -> PagedDecodeMetadata:
        def i64(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.int64).contiguous()

        meta = PagedDecodeMetadata(i64(req_pool_indices), i64(seq_lens), i64(fb.out_cache_loc))
        if SHARED_PREFIX_DECODE and meta.req_pool_indices.numel() >= 2:
            # Grouping pays where a group has enough query rows to fill the prefix kernel's
            # register blocks: measured on a Zen 4 core (9 q / 3 KV heads), from ~40 rows and
            # 128 shared tokens; below that the per-request kernel is as fast or faster.
            meta.groups = cpu_ops.decode_prefix_groups(
                fb.req_to_token_pool.req_to_token,
                meta.req_pool_indices,
                meta.seq_lens,
                min_prefix=SHARED_PREFIX_MIN_TOKENS,
                min_members=max(2, math.ceil(SHARED_PREFIX_MIN_ROWS / self.group_size)),
            )
        return meta


# WORKBENCH_SHARED_PREFIX_DECODE=0 turns grouped (cascade) decode attention off, for A/B runs.
SHARED_PREFIX_DECODE = os.environ.get("WORKBENCH_SHARED_PREFIX_DECODE", "1") != "0"
SHARED_PREFIX_MIN_TOKENS = 128
SHARED_PREFIX_MIN_ROWS = 40
