"""Tensor-parallel group state: rank, size, the process groups, and the collectives the engine needs.

One torch.distributed world per TP group (a DP replica is a separate world). Two groups:
- the *device* group (the default group: gloo on CPU, NCCL on CUDA) carries the model's
  all-reduce / all-gather and the sampled-token sync, always from the thread running the model;
- the *CPU* group (gloo) carries the scheduler's per-iteration broadcast of the received
  messages and small agreements (KV pool size, weight-update outcome). Keeping it apart lets
  the overlap loop broadcast on the scheduler thread while the forward thread all-reduces.

With tp_size 1 every collective is the identity, so the single-device path pays nothing.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
from workbench.core.distributed.topology import split_addr

DEFAULT_TIMEOUT_S = 1800.0


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup for the model's collectives
    cpu_group: object | None = None  # gloo ProcessGroup for message broadcast (None when size 1)


_TP = TPGroup()
_MOE_EP_SIZE = 1  # expert-parallel groups inside the TP group (--ep-size); layers read it when built


def set_moe_ep_size(size: int) -> None:
    """Record --ep-size before the model is built (mixture-of-experts layers split their experts by it)."""
    global _MOE_EP_SIZE
    _MOE_EP_SIZE = int(size)


def get_moe_ep_size() -> int:
    return _MOE_EP_SIZE


def set_tp_group(rank: int, size: int, group=None, cpu_group=None) -> None:
    """Record this process's TP coordinates (layers read them when they are built)."""
    global _TP
    _TP = TPGroup(rank, size, group, cpu_group if cpu_group is not None else group)


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.size


def get_tp_group() -> TPGroup:
    return _TP


def init_tp_group(
    tp_rank: int, tp_size: int, init_addr: str, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Join the TP world at `init_addr` ("host:port"; rank 0 hosts the store) and set the groups.

    Blocks until all `tp_size` ranks have joined (or `timeout_s` passes).
    """
    import torch.distributed as dist

    if tp_size == 1:
        set_tp_group(0, 1)
        return
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; one TP group per process")
    host, port = split_addr(init_addr)
    timeout = datetime.timedelta(seconds=timeout_s)
    host = f"[{host}]" if ":" in host else host  # IPv6 literal
    dist.init_process_group(
        backend=backend, init_method=f"tcp://{host}:{port}", world_size=tp_size, rank=tp_rank, timeout=timeout
    )
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    set_tp_group(tp_rank, tp_size, dist.group.WORLD, cpu_group)


def destroy_tp_group() -> None:
    """Leave the TP world (idempotent)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    set_tp_group(0, 1)


# ---- the model's collectives (device group) ----------------------------------------------------


_BATCH_INVARIANT_REDUCE = False


def set_batch_invariant_all_reduce(enabled: bool) -> None:
    """--enable-deterministic-inference: the all-reduce sums in rank order (rank 0 + rank 1 + ...,
    after an all-gather), so an element's sum never depends on the tensor's size. gloo's ring cuts
    a tensor into chunks by its size and starts each chunk's sum at another rank; at 3 or more ranks
    the same element is then summed in another order when the batch changes."""
    global _BATCH_INVARIANT_REDUCE
    _BATCH_INVARIANT_REDUCE = bool(enabled)


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks, in place."""
    if _TP.size == 1:
        return x
    import torch.distributed as dist

    if _BATCH_INVARIANT_REDUCE:
        parts = [torch.empty_like(x) for _ in range(_TP.size)]
        dist.all_gather(parts, x.contiguous(), group=_TP.group)
        total = parts[0].to(torch.float32)
        for part in parts[1:]:
            total += part  # elementwise, one rounding per add, in rank order on every rank
        return x.copy_(total)
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


def tensor_model_parallel_broadcast_(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite `x` on every rank with rank `src`'s copy, in place."""
    if _TP.size == 1:
        return x
    import torch.distributed as dist

    dist.broadcast(x, src=src, group=_TP.group)
    return x


# ---- scheduler-level agreement (CPU group) ------------------------------------------------------


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """Rank `src`'s `data` on every rank (others pass None). Two small broadcasts, one if empty.

    The payload is opaque bytes (the caller encodes typed messages with msgspec), so nothing
    here ever unpickles what another process sent.
    """
    if _TP.size == 1:
        return data or b""
    import torch.distributed as dist

    is_src = _TP.rank == src
    payload = (data or b"") if is_src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=_TP.cpu_group)
    n = int(size.item())
    if n == 0:
        return b""
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if is_src else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=_TP.cpu_group)
    return payload if is_src else buf.numpy().tobytes()


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's `data`, in rank order, on every rank."""
    if _TP.size == 1:
        return [data]
    import torch.distributed as dist

    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(_TP.size)]
    dist.all_gather(sizes, size, group=_TP.cpu_group)
    longest = max(int(s.item()) for s in sizes)
    if longest == 0:
        return [b""] * _TP.size
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(_TP.size)]
    dist.all_gather(parts, mine, group=_TP.cpu_group)
    return [p[: int(s.item())].numpy().tobytes() for p, s in zip(parts, sizes)]


def all_reduce_min_int(value: int) -> int:
    """The smallest `value` over the TP ranks (e.g. a KV pool every rank can hold)."""
    if _TP.size == 1:
        return int(value)
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_TP.cpu_group)
    return int(t.item())
