"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from workbench.core.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        # Pad the vocab so every rank holds the same number of rows.
        self.per_partition = (num_embeddings + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.tp_rank * self.per_partition
        self.vocab_end = min(self.vocab_start + self.per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.zeros(self.per_partition, embedding_dim), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.vocab_start : self.vocab_end]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; `logits()` gathers the vocab shards from every rank."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_gather(out, dim=-1)
        return out[..., : self.num_embeddings]
