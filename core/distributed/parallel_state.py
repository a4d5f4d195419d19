"""Tensor-parallel group state: rank, size, and the two collectives the layers need.

With tp_size 1 every collective is the identity, so the single-device path pays nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Optional[object] = None   # torch.distributed ProcessGroup when size > 1


_TP = TPGroup()


def set_tp_group(rank: int, size: int, group=None) -> None:
    global _TP
    _TP = TPGroup(rank, size, group)


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    import torch.distributed as dist
    dist.all_reduce(x, group=_TP.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's shard along `dim` (e.g. vocab-parallel logits)."""
    if _TP.size == 1:
        return x
    import torch.distributed as dist
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=dim)
