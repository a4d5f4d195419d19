"""How long one forward pass would take: a roofline per component, summed.

For a pass over requests with `new[i]` tokens each and `ctx[i]` tokens of context after it:

    linear layers + LM head   max(FLOPs / achievable FLOP/s, weight bytes / achievable bandwidth)
    attention                 max(FLOPs / achievable FLOP/s, KV bytes read and written / bandwidth)
    tensor parallel           two all-reduces per layer of the pass's hidden states (ring)
    per pass                  the hardware's fixed overhead (launches, batch preparation)
    HiCache copies            load-backs (host -> device) and storage prefetches before the pass, on its
                              critical path: bytes / host_link_bw (+ bytes / storage_bw); backups
                              (device -> host) overlap with the pass: only what outlasts it is charged

Everything is per TP rank: weights, heads and KV split over `tp` devices. A mixture of experts
reads only the experts its tokens were routed to: with T*k assignments spread evenly over E
experts, E * (1 - (1 - 1/E)^(T*k)) of them on average. Decode at small batch is bound by the
weight bytes, prefill by the FLOPs; the efficiencies (hardware.py) are where reality differs from
the spec sheet, and a calibration (`scale`) multiplies the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.core.simulation.hardware import Hardware
from workbench.core.simulation.model_specs import ModelSpec


@dataclass
class StepCost:
    """One pass's predicted time and its parts, in seconds."""

    linear: float
    attention: float
    comm: float
    overhead: float
    draft: float = 0.0  # a STANDALONE draft model's passes before this verify pass (SimDrafter)
    # HiCache (`CostModel.hicache`): the copies charged to this pass: load-backs and prefetches before it,
    # and the part of its backups that outlasts it (`backup` is their whole time, overlapped, not in total).
    hicache: float = 0.0
    backup: float = 0.0

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.comm + self.overhead + self.draft + self.hicache


class CostModel:
    def __init__(
        self, model: ModelSpec, hw: Hardware, tp: int = 1, dtype_bytes: int = 2, scale: float = 1.0, calibration=None
    ):
        if tp < 1 or model.heads % tp:
            raise ValueError(f"tensor parallel size {tp} must divide the model's {model.heads} attention heads")
        self.model, self.hw, self.tp, self.dtype_bytes, self.scale = model, hw, tp, dtype_bytes, scale
        self.calibration = calibration  # calibration.Calibration: measured / predicted by pass shape
        self.flops = hw.peak_flops * hw.flop_efficiency
        self.bw = hw.mem_bw * hw.bw_efficiency

    # ---- memory ---------------------------------------------------------------------------------
    def weight_bytes_per_rank(self) -> float:
        return self.model.total_params() * self.dtype_bytes / self.tp

    def kv_bytes_per_token_per_rank(self) -> float:
        m = self.model
        kv_heads = max(1, m.kv_heads // self.tp)  # fewer KV heads than ranks: each rank keeps one
        return 2 * m.layers * kv_heads * m.head_dim * self.dtype_bytes

    def kv_pool_tokens(self, draft: CostModel | None = None) -> int:
        """The KV pool a rank can hold: its KV budget, or its memory share minus its weights. With a
        `draft` model beside it (STANDALONE speculative decoding) its weights come off the budget too
        and every token keeps the draft's KV as well as the target's."""
        hw = self.hw
        budget = (
            hw.kv_bytes if hw.kv_bytes is not None else hw.mem_bytes * hw.mem_fraction - self.weight_bytes_per_rank()
        )
        per_token = self.kv_bytes_per_token_per_rank()
        if draft is not None:
            budget -= draft.weight_bytes_per_rank()
            per_token += draft.kv_bytes_per_token_per_rank()
        tokens = int(budget // per_token)
        if tokens < 256:
            raise ValueError(
                f"{self.model.name} does not fit {hw.name} x{self.tp}: {self.weight_bytes_per_rank() / 1e9:.1f} GB of "
                f"weights per device leave room for {max(tokens, 0)} KV tokens (use more --tp-size or a bigger device)"
            )
        return tokens

    # ---- time -------------------------------------------------------------------------------------
    def step(self, new_tokens: list[int], contexts: list[int], logits_rows: int | None = None) -> StepCost:
        """The pass over requests with new_tokens[i] new tokens and contexts[i] tokens after it."""
        m, tp, b = self.model, self.tp, self.dtype_bytes
        t = sum(new_tokens)
        rows = len(new_tokens) if logits_rows is None else logits_rows
        hit = m.experts * (1.0 - (1.0 - 1.0 / m.experts) ** (t * m.top_k)) if m.experts else 0.0
        mlp_weights = m.dense_mlp_params() + m.expert_params(hit)
        lm_head = m.vocab * m.hidden
        lin_flops = 2 * t * (m.layers * m.attn_params() + m.active_mlp_params()) + 2 * rows * lm_head
        lin_bytes = b * (m.layers * m.attn_params() + mlp_weights + lm_head)
        linear = max(lin_flops / tp / self.flops, lin_bytes / tp / self.bw)

        attn_flops = 0.0
        kv_read = 0
        for n, ctx in zip(new_tokens, contexts):
            # each new token attends to the prefix and to the new tokens before it (causal)
            attn_flops += 4 * m.layers * m.heads * m.head_dim * n * (ctx - n + (n + 1) / 2)
            kv_read += ctx
        kv_bytes = (kv_read + t) * self.kv_bytes_per_token_per_rank()
        attention = max(attn_flops / tp / self.flops, kv_bytes / self.bw)

        comm = 0.0
        if tp > 1:  # ring all-reduce after attention and after the MLP, every layer
            size = t * m.hidden * b
            comm = 2 * m.layers * (self.hw.link_latency_s + 2 * (tp - 1) / tp * size / self.hw.link_bw)
        cal, overhead = self.calibration, self.hw.step_overhead_s
        fit = cal.extend_fit() if cal is not None and any(n != 1 for n in new_tokens) else None
        if fit is not None:  # a prefill: each part weighted by the calibration's fit
            a, b, c = fit
            s = self.scale
            return StepCost(linear * a * s, attention * b * s, comm * s, overhead * c * s)
        s = self.scale * (cal.factor(new_tokens) if cal is not None else 1.0)
        return StepCost(linear * s, attention * s, comm * s, overhead * s)

    def host_copy_s(self, nbytes: float) -> float:
        """A device <-> host KV copy of `nbytes` (one direction over the host link; no calibration)."""
        return nbytes / self.hw.host_link_bw

    def storage_copy_s(self, nbytes: float) -> float:
        """A storage (L3) read or write of `nbytes`."""
        return nbytes / self.hw.storage_bw

    def hicache(self, cost: StepCost, load_bytes: float, backup_bytes: float, prefetch_bytes: float = 0.0) -> StepCost:
        """Charge HiCache's copies around the pass `cost` (in place; returned): load-backs, and the
        storage prefetches feeding them (storage -> host, then host -> device, already counted in
        `load_bytes`), run before the pass reads their KV; backups run beside it on the copy stream, so
        only their time past the pass's own is charged."""
        before = self.host_copy_s(load_bytes) + self.storage_copy_s(prefetch_bytes)
        cost.backup = self.host_copy_s(backup_bytes)
        cost.hicache = before + max(0.0, cost.backup - cost.total)
        return cost
