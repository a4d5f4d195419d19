"""The GEMM work of a workload, counted from the model's shapes, and the packed linears timed alone.

A decoder's linear layers (q/k/v/o, gate/up/down and the LM head) are most of its arithmetic. For a
workload we count what any engine must run through them, at best:

- every prompt token not shared with an earlier prompt once (a perfect prefix cache: the tokens of a
  trie of the prompts), through the layers' linears but not the LM head;
- one LM-head row per request for its first output token;
- `new_tokens - 1` decode steps at the workload's batch size, each through every linear and the LM head.

Those FLOPs over a run's measured time are the run's GEMM GFLOP/s, which the throughput tables print as
a fraction of the machine's measured peak (peak.py, `workbench bench peak`): the bound no engine on
these cores can pass is that peak, not anything timed with a GEMM library.

`measure_linears` is a diagnostic: it times exactly those GEMMs here, in the bench's process, with the
model's shapes and the project's oneDNN-packed weights (random values: the time of a GEMM does not
depend on them) and a given number of threads: one decode step's linears at batch `n`, a 512-row
prefill pass's linears (per token), and the LM head at `n` rows, plus one 2048^3 GEMM through torch.
It says how fast our GEMM path is at these shapes ("linears alone" tok/s: the workload's output tokens
over the sum of those times), which a better GEMM path passes, so it is no bound.

Pure counting functions are tested without timing; `measure_linears` does the timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

PREFILL_ROWS = 512  # rows of the timed prefill pass (a chunk as the scheduler builds them)


@dataclass(frozen=True)
class LinearShapes:
    """(out_features, in_features) of one layer's linears, the layer count and the LM head."""

    per_layer: tuple[tuple[int, int], ...]
    num_layers: int
    head: tuple[int, int]

    @classmethod
    def from_config(cls, cfg) -> LinearShapes:
        """From an HF config (Llama/Qwen2-style: fused qkv and gate_up, as the project packs them)."""
        hidden = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        inter = int(cfg.intermediate_size)
        per_layer = (
            (heads * head_dim + 2 * kv_heads * head_dim, hidden),  # qkv
            (hidden, heads * head_dim),  # o
            (2 * inter, hidden),  # gate_up
            (hidden, inter),
        )  # down
        return cls(per_layer, int(cfg.num_hidden_layers), (int(cfg.vocab_size), hidden))

    def body_flops_per_token(self) -> int:
        return 2 * self.num_layers * sum(n * k for n, k in self.per_layer)

    def head_flops_per_token(self) -> int:
        return 2 * self.head[0] * self.head[1]


def unique_prompt_tokens(prompts: list[list[int]]) -> int:
    """Tokens a perfect prefix cache computes: the nodes of a trie of the prompts (a prompt's tokens
    after the longest prefix it shares with an earlier prompt)."""
    root: dict = {}
    count = 0
    for p in prompts:
        node = root
        for t in p:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                count += 1
            node = nxt
    return count


@dataclass(frozen=True)
class WorkloadWork:
    """What a workload asks of the linears, at best."""

    prefill_tokens: int  # unique prompt tokens
    requests: int  # also the decode batch size (all requests decode together)
    decode_steps: int  # new_tokens - 1
    output_tokens: int  # requests * new_tokens

    @classmethod
    def of(cls, prompts: list[list[int]], new_tokens: int) -> WorkloadWork:
        n = len(prompts)
        return cls(unique_prompt_tokens(prompts), n, max(0, new_tokens - 1), n * new_tokens)

    def flops(self, shapes: LinearShapes) -> int:
        body, head = shapes.body_flops_per_token(), shapes.head_flops_per_token()
        decode_rows = self.requests * self.decode_steps
        return self.prefill_tokens * body + self.requests * head + decode_rows * (body + head)


@dataclass(frozen=True)
class LinearTimes:
    """Best measured seconds of the GEMMs a workload needs, at one thread count."""

    threads: int
    decode_step_s: dict  # batch size -> one decode step's linears + LM head
    prefill_token_s: float  # one prompt token's share of a PREFILL_ROWS-row pass (no LM head)
    head_row_s: dict  # batch size -> the LM head at that many rows
    sgemm_gflops: float  # one 2048^3 float sgemm (torch.mm): the machine's GEMM peak here
    packed_gflops_decode: dict  # batch size -> GFLOP/s of the decode step's linears

    def linears_only_seconds(self, work: WorkloadWork) -> float:
        """Seconds the workload's linears take alone on this path (a diagnostic, not a bound)."""
        return (
            work.prefill_tokens * self.prefill_token_s
            + self.head_row_s[work.requests]
            + work.decode_steps * self.decode_step_s[work.requests]
        )

    def linears_only_tok_s(self, work: WorkloadWork, decode_only: bool = False) -> float:
        """Output tok/s if the run were these linears alone; `decode_only`: decode tok/s (batch tokens
        per decode step)."""
        if decode_only:
            return work.requests / self.decode_step_s[work.requests]
        return work.output_tokens / self.linears_only_seconds(work)


def run_gflops(work: WorkloadWork, shapes: LinearShapes, tok_s: float, decode_only: bool = False) -> float | None:
    """The GEMM GFLOP/s of a run of `work` at `tok_s` output tokens a second (`decode_only`: decode
    tok/s, so each token is one row through every linear and the LM head)."""
    if not tok_s or tok_s != tok_s:
        return None
    if decode_only:
        return tok_s * (shapes.body_flops_per_token() + shapes.head_flops_per_token()) / 1e9
    return work.flops(shapes) * tok_s / work.output_tokens / 1e9


def needed_fraction(peer_fraction: float | None, goal: float) -> float | None:
    """The share of the peak `goal` times the peer's rate would take (> 1: beyond these cores)."""
    if peer_fraction is None or peer_fraction != peer_fraction:
        return None
    return goal * peer_fraction


def measure_linears(cfg, dtype: str, threads: int, batch_sizes, repeats: int = 5) -> LinearTimes:
    """Time the GEMMs of `cfg`'s linears here with `threads` threads (restored afterwards)."""
    import torch

    from workbench.core.layers.linear import pack_linear_weight, packed_linear

    shapes = LinearShapes.from_config(cfg)
    dt = getattr(torch, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    try:
        gen = torch.Generator().manual_seed(0)

        def weight(n, k):
            # as the model runner holds it: oneDNN-packed where that path exists (float32 here;
            # bfloat16 needs AVX-512 or AMX), else the plain weight on torch's own GEMM
            w = (torch.randn(n, k, generator=gen) * 0.02).to(dt)
            packed = pack_linear_weight(w)
            return (True, packed) if packed is not None else (False, w)

        def apply(x, w):
            is_packed, tensor = w
            return packed_linear(x, tensor, None) if is_packed else torch.nn.functional.linear(x, tensor)

        layers = [[weight(n, k) for n, k in shapes.per_layer] for _ in range(shapes.num_layers)]
        head = weight(*shapes.head)
        widths = {k for _, k in shapes.per_layer}

        def best(fn) -> float:
            fn()
            b = float("inf")
            for _ in range(max(1, repeats)):
                t = time.perf_counter()
                fn()
                b = min(b, time.perf_counter() - t)
            return b

        def body_pass(rows: int):
            xs = {k: torch.randn(rows, k, generator=gen).to(dt) for k in widths}

            def run():
                for ws in layers:
                    for (_, k), w in zip(shapes.per_layer, ws):
                        apply(xs[k], w)

            return run

        def head_pass(rows: int):
            x = torch.randn(rows, shapes.head[1], generator=gen).to(dt)
            return lambda: apply(x, head)

        decode, heads, gflops = {}, {}, {}
        for bs in sorted(set(int(b) for b in batch_sizes)):
            heads[bs] = best(head_pass(bs))
            decode[bs] = best(body_pass(bs)) + heads[bs]
            gflops[bs] = bs * (shapes.body_flops_per_token() + shapes.head_flops_per_token()) / decode[bs] / 1e9
        prefill = best(body_pass(PREFILL_ROWS)) / PREFILL_ROWS
        a = torch.randn(2048, 2048, generator=gen).to(dt)
        sgemm = 2 * 2048**3 / best(lambda: torch.mm(a, a)) / 1e9
        return LinearTimes(int(threads), decode, prefill, heads, sgemm, gflops)
    finally:
        torch.set_num_threads(before)
