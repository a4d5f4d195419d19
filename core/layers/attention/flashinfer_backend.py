"""Attention with FlashInfer's batch wrappers over the token-slot KV pool (page size 1).

The pool's per-layer K/V buffers `[slots, Hk, D]` are FlashInfer's paged cache in
NHD layout with one token per page (`buffer.unsqueeze(1)`: `[pages, 1, Hk, D]`,
a view, no copy), so a request's page list is simply its slot row in
`req_to_token`, and every last page holds exactly one token.

- Decode: `BatchDecodeWithPagedKVCacheWrapper`, planned once per pass.
- Extend: the new tokens attend to themselves through
  `BatchPrefillWithRaggedKVCacheWrapper` (causal, contiguous K/V straight from the
  projection) and, when any request has a cached prefix, to that prefix through
  `BatchPrefillWithPagedKVCacheWrapper` (non-causal); the two partial results are
  merged by their log-sum-exps (`merge_state`), as SGLang does.
- CUDA graphs: one decode wrapper per captured batch size with `use_cuda_graph=True`
  over fixed index buffers; each replay re-plans it for the live batch (planning
  runs on the host, outside the graph).

Everything here needs CUDA and the `flashinfer-python` package; the import is
guarded so the module loads anywhere (`flashinfer_unavailable_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from workbench.core.layers.attention.base_attn_backend import AttentionBackend

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's float workspace, shared by all wrappers (as SGLang)


def flashinfer_unavailable_reason(device: str, dtype=None) -> str | None:
    """None when the flashinfer backend can run on `device` (and `dtype`, a torch.dtype or a
    --dtype name, if given), else what to do about it."""
    if device != "cuda":
        return "the flashinfer attention backend runs on CUDA only; use --attention-backend torch_native on CPU"
    if dtype is not None and str(dtype).replace("torch.", "") == "float32":
        # Its kernels are built for 16-bit activations only (found on a real H100: KeyError float32).
        return (
            "the flashinfer attention backend runs float16/bfloat16 models only; use --dtype bfloat16, "
            "or --attention-backend triton for float32"
        )
    try:
        import flashinfer  # noqa: F401
    except ImportError as exc:
        return (
            f"the flashinfer attention backend needs `flashinfer-python` ({exc}); "
            "pip install flashinfer-python, or pick --attention-backend triton"
        )
    return None


@dataclass
class FlashInferDecodeMetadata:
    wrapper: Any  # a planned BatchDecodeWithPagedKVCacheWrapper


@dataclass
class FlashInferExtendMetadata:
    ragged: Any  # planned BatchPrefillWithRaggedKVCacheWrapper (new tokens, causal)
    paged: Any | None  # planned BatchPrefillWithPagedKVCacheWrapper (prefixes), or None


def kv_indices_from_rows(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor, lens_cpu: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(indptr [B+1] int32, indices [sum(lens)] int32): the first lens[b] slots of each request's row.

    Pure torch, device-neutral (unit-tested on CPU); the boolean gather syncs with the
    host, which is fine because it runs at plan time, outside any CUDA graph.
    """
    bs = len(lens_cpu)
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device=req_to_token.device)
    if bs:
        indptr[1:] = torch.cumsum(lens.to(torch.int32), 0)
    max_len = max(lens_cpu, default=0)
    if max_len == 0:
        return indptr, torch.zeros(0, dtype=torch.int32, device=req_to_token.device)
    table = req_to_token.index_select(0, req_pool_indices)[:, :max_len]
    valid = torch.arange(max_len, device=table.device).unsqueeze(0) < lens.unsqueeze(1)
    return indptr, table[valid].to(torch.int32)


class FlashInferAttnBackend(AttentionBackend):
    """FlashInfer batch decode / prefill over the token pool, page size 1."""

    name = "flashinfer"
    cuda_graph_capturable = True

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: str,
    ):
        reason = flashinfer_unavailable_reason(torch.device(device).type, dtype)
        if reason:
            raise RuntimeError(reason)
        import flashinfer

        self._fi = flashinfer
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.scaling = scaling
        self.dtype, self.kv_dtype = dtype, kv_dtype
        self.device = torch.device(device)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # Tensor-core decode pays off once several query heads share a KV head (SGLang's rule of thumb).
        self.use_tensor_cores = num_q_heads // num_kv_heads >= 4
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.prefill_ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self.prefill_paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_indptr: torch.Tensor | None = None
        self._graph_indices: torch.Tensor | None = None
        self._graph_last_page_len: torch.Tensor | None = None
        self._ones = torch.ones(1, dtype=torch.int32, device=self.device)

    # ---- planning (once per pass) ------------------------------------------------------
    def _last_page_len(self, bs: int) -> torch.Tensor:
        if self._ones.numel() < bs:
            self._ones = torch.ones(bs, dtype=torch.int32, device=self.device)
        return self._ones[:bs]

    def _plan_decode(self, wrapper, indptr: torch.Tensor, indices: torch.Tensor, bs: int) -> None:
        # data_type too: in some 0.2 releases it defaults to float16 and overrides q/kv_data_type.
        wrapper.plan(
            indptr,
            indices,
            self._last_page_len(bs),
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            pos_encoding_mode="NONE",
            data_type=self.kv_dtype,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
            sm_scale=self.scaling,
        )

    def init_forward_metadata(self, fb) -> None:
        req_to_token = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode():
            indptr, indices = kv_indices_from_rows(req_to_token, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu)
            self._plan_decode(self.decode_wrapper, indptr, indices, fb.batch_size)
            fb.attn_metadata = FlashInferDecodeMetadata(self.decode_wrapper)
            return
        dev = self.device
        ext = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int32)
        qo_indptr = torch.zeros(len(ext) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(ext, 0)
        qo_indptr = qo_indptr.to(dev)
        self.prefill_ragged.plan(
            qo_indptr,
            qo_indptr,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            causal=True,
            sm_scale=self.scaling,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        paged = None
        if any(fb.extend_prefix_lens_cpu):
            prefix = torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64, device=dev)
            kv_indptr, kv_indices = kv_indices_from_rows(
                req_to_token, fb.req_pool_indices, prefix, fb.extend_prefix_lens_cpu
            )
            self.prefill_paged.plan(
                qo_indptr,
                kv_indptr,
                kv_indices,
                self._last_page_len(fb.batch_size),
                self.num_q_heads,
                self.num_kv_heads,
                self.head_dim,
                1,
                causal=False,
                sm_scale=self.scaling,
                q_data_type=self.dtype,
                kv_data_type=self.kv_dtype,
            )
            paged = self.prefill_paged
        fb.attn_metadata = FlashInferExtendMetadata(self.prefill_ragged, paged)

    # ---- attention -------------------------------------------------------------------------
    @staticmethod
    def _paged_cache(pool, layer_id: int):
        # [slots, Hk, D] -> [pages, page_size=1, Hk, D]: FlashInfer's NHD paged layout, a view.
        return pool.get_key_buffer(layer_id).unsqueeze(1), pool.get_value_buffer(layer_id).unsqueeze(1)

    def forward_extend(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        meta: FlashInferExtendMetadata = fb.attn_metadata
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if meta.paged is None:
            return meta.ragged.run(q, k, v)
        o_new, lse_new = meta.ragged.run(q, k, v, return_lse=True)
        o_pre, lse_pre = meta.paged.run(q, self._paged_cache(pool, layer.layer_id), return_lse=True)
        o, _ = self._fi.merge_state(o_pre, lse_pre, o_new, lse_new)
        return o.to(q.dtype)

    def forward_decode(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        meta: FlashInferDecodeMetadata = fb.attn_metadata
        return meta.wrapper.run(q.contiguous(), self._paged_cache(pool, layer.layer_id))

    # ---- CUDA-graph hooks ----------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_indices = torch.zeros(max_num_tokens, dtype=torch.int32, device=self.device)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_batch) -> None:
        if self._graph_indptr is None:
            raise RuntimeError("call init_cuda_graph_state before capturing")
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=self._graph_indptr[: bs + 1],
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs],
        )
        self._graph_wrappers[bs] = wrapper
        seq_lens_cpu = seq_lens[:bs].tolist()
        self.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_cpu, forward_batch)

    def init_forward_metadata_replay_cuda_graph(
        self, bs, req_pool_indices, seq_lens, seq_lens_cpu, forward_batch
    ) -> None:
        wrapper = self._graph_wrappers[bs]
        indptr, indices = kv_indices_from_rows(
            forward_batch.req_to_token_pool.req_to_token, req_pool_indices[:bs], seq_lens[:bs], list(seq_lens_cpu[:bs])
        )
        # A CUDA-graph wrapper's plan copies indptr/indices into the fixed buffers the graph reads.
        self._plan_decode(wrapper, indptr, indices, bs)
        forward_batch.attn_metadata = FlashInferDecodeMetadata(wrapper)
