"""The attention-backend interface every backend (torch_native, triton, flashinfer) implements."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from workbench.core.layers.attention.masked_attention import masked_attention, needs_masked_path

if TYPE_CHECKING:
    from workbench.core.layers.radix_attention import RadixAttention
    from workbench.core.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend:
    """Attention over the token-slot KV pool, with per-pass metadata and CUDA-graph hooks.

    A pass calls `init_forward_metadata` once, then every layer calls `forward`
    (which writes this pass's K/V to the pool and attends). Decode passes replayed
    from a CUDA graph skip `init_forward_metadata`: the graph runner calls the
    `*_cuda_graph` hooks instead, which must leave the metadata in buffers whose
    addresses never change (the graph reads them by address).
    """

    name = "base"
    # True when the decode path reads only static buffers and never syncs with the host,
    # i.e. it may be captured into a real CUDA graph. Backends without it can still run
    # under the CPU stand-in graph (which re-runs Python at replay).
    cuda_graph_capturable = False
    # True when a speculative verify pass (TARGET_VERIFY, a fixed number of rows per request) can
    # read its extend metadata from the graph runner's static buffers (cuda_graph_verify.py).
    verify_cuda_graph_capturable = False

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute per-pass metadata (index tables, masks) shared by every layer."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        if (layer.sliding_window_size or layer.logit_cap) and needs_masked_path(layer, forward_batch):
            return masked_attention(q, k, v, layer, forward_batch)  # a window or a soft cap: explicit scores
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch) -> torch.Tensor:
        raise NotImplementedError

    def forward_decode(self, q, k, v, layer, forward_batch) -> torch.Tensor:
        raise NotImplementedError

    # ---- CUDA-graph hooks (decode only) ------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the static metadata buffers for batches of up to `max_bs` rows.

        `max_num_tokens` bounds the KV slots all rows of one batch can hold together.
        """
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, forward_batch: ForwardBatch
    ) -> None:
        """Before capturing bucket `bs`: point `forward_batch.attn_metadata` at static buffers.

        `req_pool_indices` and `seq_lens` are the graph's static input buffers (first
        `bs` rows), already holding dummy rows.
        """
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: list[int],
        forward_batch: ForwardBatch,
    ) -> None:
        """Before replaying bucket `bs`: refresh the static metadata for the (padded) batch now
        in the input buffers; `seq_lens_cpu` are the same lengths on the host."""
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs")

    # ---- CUDA-graph hooks for verify passes (speculative decoding) -----------------------------
    # The defaults build the metadata on the host like an eager pass: right for the CPU stand-in
    # graph, which re-runs Python at replay; a backend that sets verify_cuda_graph_capturable
    # points the metadata at `buffers` (StaticVerifyBuffers) instead.
    def init_forward_metadata_capture_verify_cuda_graph(self, bs: int, buffers, forward_batch: ForwardBatch) -> None:
        """Before capturing the verify graph of bucket `bs` (dummy requests in `buffers`)."""
        self.init_forward_metadata(forward_batch)

    def init_forward_metadata_replay_verify_cuda_graph(self, bs: int, buffers, forward_batch: ForwardBatch) -> None:
        """Before replaying it: `buffers` and the batch's host lengths hold the padded batch."""
        self.init_forward_metadata(forward_batch)
