"""Tensor-parallel-aware linear layers (Megatron style).

Each layer holds only its rank's shard and knows how to cut that shard out of a
full checkpoint tensor (`weight_loader`). With tp_size 1 they are plain linears.
- ColumnParallelLinear: output features split across ranks (no communication).
- RowParallelLinear: input features split; partial outputs all-reduced.
- QKVParallelLinear / MergedColumnParallelLinear: several column-parallel
  projections fused into one matmul (fewer ops per layer matters on CPU).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from workbench.core.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor-parallel size ({b})")
    return a // b


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.output_size_per_partition = _divide(output_size, self.tp_size, "output size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.output_size_per_partition), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one weight (e.g. gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        sizes = [s // self.tp_size for s in self.output_sizes]
        offset = sum(sizes[:shard_id])
        n = sizes[shard_id]
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; heads split across ranks (KV heads must divide too)."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False):
        tp = get_tp_size()
        self.num_heads = _divide(total_num_heads, tp, "number of attention heads")
        self.num_kv_heads = _divide(total_num_kv_heads, tp, "number of key/value heads")
        self.head_dim = head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        offset, n = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, self.tp_rank * n, n))


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size_per_partition = _divide(input_size, self.tp_size, "input size")
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:   # the bias is not split; only rank 0 adds it (see forward)
            param.data.copy_(loaded)
            return
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias: Optional[torch.Tensor] = self.bias if self.tp_rank == 0 else None
        out = F.linear(x, self.weight, bias)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
