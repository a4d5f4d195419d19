"""The attention layer models call: it only names the layer; the backend does the work."""

from __future__ import annotations

import torch
from torch import nn


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq, D]."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
