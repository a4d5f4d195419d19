"""The attention-backend interface every backend (torch_native, triton, flashinfer) implements."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workbench.core.layers.radix_attention import RadixAttention
    from workbench.core.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend:
    name = "base"

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Precompute per-pass metadata (index tables, masks) shared by every layer."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch) -> torch.Tensor:
        raise NotImplementedError

    def forward_decode(self, q, k, v, layer, forward_batch) -> torch.Tensor:
        raise NotImplementedError

    # CUDA-graph hooks: a backend that supports graphs keeps static metadata buffers.
    def init_cuda_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices, seq_lens) -> None:
        raise NotImplementedError

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices, seq_lens) -> None:
        raise NotImplementedError
