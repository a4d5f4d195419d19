"""Mixture-of-experts MLP: a top-k router and the experts' stacked weights (SGLang's FusedMoE names).

`TopKRouter` scores each token against every expert (a replicated [E, H] gate), takes the
softmax in float32, keeps the top k and, where the model says so, renormalises the kept
weights to sum to 1 (Mixtral and Qwen3-MoE do; OLMoE does not). `FusedMoE` holds every
expert's gate and up projections stacked as `w13_weight` [E, 2I, H] and the down projections
as `w2_weight` [E, H, I], and computes sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x)).

How tokens meet experts, on any device: the T x k (token, expert) assignments are sorted by
expert once, so each expert that received tokens runs two GEMMs over exactly its tokens (a
loop over the experts that were hit, never over tokens), and the weighted outputs are
scattered back with one index_add. Tensor parallel splits each expert's intermediate size
across ranks (like the dense MLP: w13 by rows, w2 by columns) and all-reduces the sum.

Expert parallelism (`--ep-size`, SGLang's spelling) divides the TP group's ranks into ep_size
groups; group g holds whole experts g * E/ep .. (g + 1) * E/ep - 1, their intermediate size split
over the tp/ep ranks of the group (ep == tp: each rank holds E/tp complete experts). Every rank
still sees every token (the hidden states are replicated under TP) and computes only its own
experts' share, so the same all-reduce sums the layer: nothing is dispatched between ranks.

Each call keeps its tokens' expert ids (`last_topk_ids`), which the model runner hands to the
trace's routing summary (under a CUDA graph, the graph's static copy of them: cuda_graph_runner.py).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn
from workbench.core.distributed.parallel_state import (
    get_moe_ep_size,
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_reduce,
)


class TopKRouter(nn.Module):
    """weight [E, H]; forward(x [T, H]) -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class FusedMoE(nn.Module):
    """The experts this rank holds: w13_weight [E_local, 2I/moe_tp, H] (gate rows, then up rows) and
    w2_weight [E_local, H, I/moe_tp], E_local = E / ep_size, moe_tp = tp_size / ep_size."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        ep = get_moe_ep_size()
        if self.tp_size % ep or num_experts % ep:
            raise ValueError(
                f"--ep-size {ep} must divide --tp-size {self.tp_size} and the {num_experts} experts of each layer"
            )
        self.moe_tp_size = self.tp_size // ep  # ranks sharing one group of experts
        self.moe_tp_rank = self.tp_rank % self.moe_tp_size
        if intermediate_size % self.moe_tp_size:
            raise ValueError(
                f"the experts' intermediate size {intermediate_size} does not split over {self.moe_tp_size} ranks"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.first_expert = (self.tp_rank // self.moe_tp_size) * self.num_local_experts
        self.intermediate_per_rank = intermediate_size // self.moe_tp_size
        i, e = self.intermediate_per_rank, self.num_local_experts
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i), requires_grad=False)
        self.last_counts: torch.Tensor | None = None  # [E] int64: tokens per expert, last call (CPU loop)
        self.last_topk_ids: torch.Tensor | None = None  # [T, k]: each token's experts, last call

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard: str) -> None:
        """One expert's HF tensor: shard "w1" (gate [I, H]), "w3" (up [I, H]) or "w2" (down [H, I]).
        Experts another expert-parallel group holds are skipped."""
        if shard not in ("w1", "w2", "w3"):
            raise ValueError(f"expert shard {shard!r} is not w1, w2 or w3")
        local = expert_id - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        i, r = self.intermediate_per_rank, self.moe_tp_rank
        if shard == "w2":
            param.data[local].copy_(loaded.narrow(1, r * i, i))
            return
        first = 0 if shard == "w1" else i  # gate rows first, then up rows
        param.data[local, first : first + i].copy_(loaded.narrow(0, r * i, i))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_* [T, k] -> [T, H] in x's dtype (all-reduced over tensor-parallel ranks)."""
        t, k = topk_ids.shape
        self.last_topk_ids = topk_ids
        if use_triton_experts(x):  # CUDA: grouped GEMMs on the device, no host sync (moe_triton.py)
            from workbench.core.layers.moe_triton import fused_experts

            out = fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.first_expert)
            return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out
        flat = topk_ids.reshape(-1)
        # (Only here: bincount reads the largest id on the host, which a CUDA graph cannot capture.)
        self.last_counts = torch.bincount(flat, minlength=self.num_experts)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order within
        token_of = order // k
        weight_of = topk_weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
        counts = self.last_counts.tolist()
        out = torch.zeros_like(x)
        i, first = self.intermediate_per_rank, self.first_expert
        start = sum(counts[:first])  # the assignments of experts other groups hold come before ours
        for local in range(self.num_local_experts):
            n = counts[first + local]
            if n == 0:
                continue
            rows = token_of[start : start + n]
            h = F.linear(x.index_select(0, rows), self.w13_weight[local])
            h = F.silu(h[:, :i]) * h[:, i:]
            out.index_add_(0, rows, F.linear(h, self.w2_weight[local]) * weight_of[start : start + n])
            start += n
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


def use_triton_experts(x: torch.Tensor) -> bool:
    """The Triton experts on CUDA; on CPU only under Triton's interpreter when WORKBENCH_MOE_TRITON=1
    (how the tests check the kernel against the loop above)."""
    if x.is_cuda:
        return _triton_installed()  # without triton, CUDA runs the loop below too
    return os.environ.get("WORKBENCH_MOE_TRITON") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=1)
def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


class SparseMoeBlock(nn.Module):
    """Router + experts with the residual add of the dense MLP's interface: forward(x, residual)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return out if residual is None else out + residual


def sparse_moe_blocks(model: nn.Module) -> list[tuple[int, SparseMoeBlock]]:
    """(layer id, block) of every decoder layer whose MLP is a mixture of experts; [] for dense models."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return [(i, layer.mlp) for i, layer in enumerate(layers) if isinstance(getattr(layer, "mlp", None), SparseMoeBlock)]
