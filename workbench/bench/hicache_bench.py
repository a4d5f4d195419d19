"""`workbench bench hicache`: TTFT of a prompt served from the host tier vs the device vs recomputed.

One engine with HiCache on (`--enable-hierarchical-cache`, write_through unless told otherwise)
and a device KV pool just large enough for the longest prompt and some room. For each prompt
length, in each round, a fresh random prompt P is sent three ways, one new token each (so the
request's time is its time to first token):

- recompute: P for the first time (nothing cached);
- device hit: P again right away (its prefix is on the device);
- host hit: P after filler prompts have pushed it off the device (it comes back from host).

The table gives the medians over the rounds, the cached tokens each way reported (host hits must
report the prompt as cached, or the row says so), and the load-back time the trace reports (the
host -> device copy; on CPU a synchronous copy between two sets of tensors, on CUDA queued on its
own stream).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from workbench.bench.harness import engine_parser, load_text, markdown_table, progress
from workbench.core.trace import events as ev

DEFAULT_LENGTHS = (128, 512, 1024)
QUICK_LENGTHS = (64, 128)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [1] + [rng.randrange(1000, 20000) for _ in range(n - 1)]


def _ttft(engine, prompt: list[int]) -> tuple[float, int]:
    """Wall time of a one-token request (its TTFT plus the engine's fixed IPC) and its cached tokens."""
    t0 = time.perf_counter()
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    return (time.perf_counter() - t0) * 1000.0, int(out["meta_info"]["cached_tokens"])


def _drain_load_ms(sub, settle_s: float = 0.3) -> list[float]:
    """Load-back ms the trace reported since the last drain (events travel their own socket)."""
    out, last = [], time.monotonic()
    while time.monotonic() - last < settle_s:
        got = sub.drain()
        if got:
            out += [e.ms for e in got if isinstance(e, ev.HiCacheTransfer) and e.what == "load_back"]
            last = time.monotonic()
        else:
            time.sleep(0.02)
    return out


def run_hicache_bench(args: argparse.Namespace) -> dict:
    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine

    lengths = QUICK_LENGTHS if args.quick else tuple(args.lengths)
    rounds = 1 if args.quick else args.rounds
    sa = ServerArgs.from_cli_args(args)
    sa.show_progress = False
    sa.enable_hierarchical_cache = True
    if not sa.max_total_tokens:
        sa.max_total_tokens = 2 * max(lengths) + 64  # small, so filler prompts push P off the device
    if sa.hicache_size == 0 and sa.hicache_ratio == ServerArgs.hicache_ratio:
        sa.hicache_ratio = 4.0  # room on host for P and every filler, so P is never the host's LRU victim
    # Fillers just over the device pool: P leaves the device, and the host (ratio x the pool) keeps it.
    filler_len = min(128, max(lengths))
    fillers = -(-sa.max_total_tokens // filler_len) + 1
    rng = random.Random(args.prompt_seed)
    rows: dict[int, dict[str, list[float]]] = {
        n: {"recompute": [], "device": [], "host": [], "load": []} for n in lengths
    }
    cached: dict[int, dict[str, int]] = {n: {} for n in lengths}
    loads = [load_text()]
    with Engine(server_args=sa) as engine:
        sub = engine.subscribe(with_snapshot=False, name="bench-hicache")
        _ttft(engine, _prompt(rng, 16))  # warm-up
        for r in range(rounds):
            for n in lengths:
                progress(f"round {r + 1}/{rounds}: {n}-token prompt")
                p = _prompt(rng, n)
                ms, c = _ttft(engine, p)
                rows[n]["recompute"].append(ms)
                cached[n]["recompute"] = c
                ms, c = _ttft(engine, p)
                rows[n]["device"].append(ms)
                cached[n]["device"] = c
                for _ in range(fillers):
                    _ttft(engine, _prompt(rng, filler_len))
                _drain_load_ms(sub, 0.05)
                ms, c = _ttft(engine, p)
                rows[n]["host"].append(ms)
                cached[n]["host"] = c
                rows[n]["load"] += _drain_load_ms(sub)
            loads.append(load_text())
        sub.close()
    med = statistics.median
    table = []
    out = {}
    for n in lengths:
        d = rows[n]
        rec, dev, host = med(d["recompute"]), med(d["device"]), med(d["host"])
        load = med(d["load"]) if d["load"] else float("nan")
        note = "" if cached[n].get("host", 0) > 0 else " (not served from host!)"
        table.append(
            [
                str(n),
                f"{rec:.1f}",
                f"{dev:.1f} ({cached[n]['device']})",
                f"{host:.1f} ({cached[n]['host']}){note}",
                f"{load:.2f}",
            ]
        )
        out[n] = {"recompute_ms": rec, "device_ms": dev, "host_ms": host, "load_back_ms": load}
    print(
        f"\nHiCache TTFT (ms, medians of {rounds} round(s); one new token; cached tokens in brackets); device pool "
        f"{sa.max_total_tokens} tokens, host {sa.hicache_ratio:g}x, write policy {sa.hicache_write_policy}, "
        f"dtype {sa.dtype}; "
        f"load average {' → '.join(loads)}"
    )
    print(
        markdown_table(
            ["prompt tokens", "recompute", "device hit", "host hit", "load-back ms"],
            table,
        )
    )
    print(
        "load-back ms: the host -> device copy (all layers) the trace reports for the host hit; the rest of a "
        "host hit's TTFT is the device hit's work (one token computed)"
    )
    return out


def add_parser(bench_sub) -> None:
    p = engine_parser(
        bench_sub,
        "hicache",
        help="TTFT of a HiCache host-tier hit vs a device hit vs recomputing, for several prompt lengths",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="prompt lengths in tokens to measure"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds per length (medians are printed)")
    p.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke test)")
    p.set_defaults(func=lambda a: 0 if run_hicache_bench(a) else 1)
