"""The attention layer models call: it only names the layer; the backend does the work."""

from __future__ import annotations

import torch
from torch import nn


class RadixAttention(nn.Module):
    """One layer's attention over the KV pool.

    `sliding_window_size` (SGLang's name): a query at position p sees keys p - window + 1 .. p only
    (Mistral, and Gemma's local layers); None for full attention. `logit_cap` soft-caps the scores,
    cap * tanh(score / cap), before the softmax (Gemma 2); 0 for none. Layers with either go through
    the backends' explicit-score path (attention/masked_attention.py) whenever it changes the result.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        sliding_window_size: int | None = None,
        logit_cap: float = 0.0,
    ):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window_size = int(sliding_window_size) if sliding_window_size else None
        self.logit_cap = float(logit_cap or 0.0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq, D]."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
