"""The batched LoRA forward: each adapter's rows of a batch through its own A and B.

A batch mixes requests of several adapters (and of the base model). The rows of one forward pass
are the requests' new tokens, contiguous per request, so grouping them by adapter gives one
index list per adapter (`LoRABatch.segments`). In every projection an adapter targets, its rows
get x[rows] @ A^T @ (B*scaling)^T added to the base output: two small GEMMs per adapter and
projection (grouped torch ops, the CPU counterpart of SGLang's segmented GEMM kernels); the base
model's rows add nothing.

The model fuses projections (q/k/v in qkv_proj, gate/up in gate_up_proj), so one host layer may
carry up to three adapter targets, each writing its own slice of the fused output: their A's are
stacked into one [in, sum of r] matrix (one GEMM for x's down projection), then each target's B
writes its slice. Under tensor parallelism each rank holds the slices of its shard: column-parallel
hosts cut B's rows, row-parallel hosts (o_proj, down_proj) cut A's columns and add the partial
delta before the all-reduce, which sums it with the base output's partial sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# PEFT target -> (host attribute path within a decoder layer, slice index within the fused host;
# FUSED: the target is the fused projection itself, as Phi-3's checkpoints name it (qkv_proj, gate_up_proj),
# whose B is cut into the host's slices).
FUSED = -1
TARGET_HOSTS: dict[str, tuple[str, int]] = {
    "qkv_proj": ("self_attn.qkv_proj", FUSED),
    "gate_up_proj": ("mlp.gate_up_proj", FUSED),
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}


@dataclass
class HostDelta:
    """One adapter's weights on one host layer, on this rank: a_t [in, sum r] (the targets' A's
    stacked, transposed) and per target (out offset, out size, r offset, b_t [r, out size])."""

    a_t: torch.Tensor
    slices: list[tuple[int, int, int, torch.Tensor]]


@dataclass
class LoRABatch:
    """The adapters of the pass being run: (per-host deltas of the adapter, its rows or None for all)."""

    segments: list[tuple[dict[str, HostDelta], torch.Tensor | None]]


class LoRAHook:
    """Attached to a host linear (`LinearBase.lora_hook`); adds the running batch's adapter deltas."""

    def __init__(self, state: LoRAState, key: str):
        self.state = state
        self.key = key  # "{layer}.{host path}"

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        batch = self.state.batch
        if batch is None:
            return out
        for deltas, rows in batch.segments:
            d = deltas.get(self.key)
            if d is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            h = xs @ d.a_t
            for off, size, r_off, b_t in d.slices:
                y = h[:, r_off : r_off + b_t.shape[0]] @ b_t
                if rows is None:
                    out[:, off : off + size] += y
                else:
                    out[:, off : off + size].index_add_(0, rows, y)
        return out


class LoRAState:
    """Shared by every hook of a model: the batch the next forward pass runs (None: base model only)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


def host_slices(host, tp_rank: int) -> dict[int, tuple[int, int, str, int]]:
    """For a host linear: slice index -> (out offset, out size on this rank, how to shard, shard index).

    How to shard: "B" (cut B's rows at tp_rank * size: column-parallel) or "A" (cut A's columns:
    row-parallel, whose input is split)."""
    from workbench.core.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    if isinstance(host, QKVParallelLinear):
        q, kv = host.num_heads * host.head_dim, host.num_kv_heads * host.head_dim
        return {0: (0, q, "B", tp_rank), 1: (q, kv, "B", tp_rank), 2: (q + kv, kv, "B", tp_rank)}
    if isinstance(host, MergedColumnParallelLinear):
        sizes = [s // host.tp_size for s in host.output_sizes]
        return {i: (sum(sizes[:i]), n, "B", tp_rank) for i, n in enumerate(sizes)}
    if isinstance(host, RowParallelLinear):
        return {0: (0, host.weight.shape[0], "A", tp_rank)}
    return {0: (0, host.weight.shape[0], "B", tp_rank)}


def build_host_delta(host, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], tp_rank: int, device) -> HostDelta:
    """Stack the A's of the targets on one host and cut this rank's shard (parts: slice -> (A, B*s))."""
    layout = host_slices(host, tp_rank)
    a_rows: list[torch.Tensor] = []
    slices: list[tuple[int, int, int, torch.Tensor]] = []
    r_off = 0
    in_size = host.weight.shape[1]
    for idx in sorted(parts):
        a, b = parts[idx]
        off, size, shard, rank = layout[idx]
        if shard == "A":
            a = a.narrow(1, rank * in_size, in_size)
        else:
            b = b.narrow(0, rank * size, size)
        if a.shape[1] != in_size or b.shape[0] != size:
            raise ValueError(f"A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a [{size}, {in_size}] projection")
        a_rows.append(a)
        slices.append((off, size, r_off, b.t().contiguous().to(device)))
        r_off += a.shape[0]
    return HostDelta(torch.cat(a_rows, 0).t().contiguous().to(device), slices)
