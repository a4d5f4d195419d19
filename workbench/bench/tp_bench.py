"""`workbench bench tp`: request latency at several tensor-parallel sizes, same model, same prompts.

For each `--tp-sizes` entry it starts an Engine, warms it up, then measures
  - one request at a time: TTFT and the mean time per output token (TPOT), median of `--repeats`;
  - `--batch` concurrent requests: end-to-end seconds and output tok/s.
On one CPU the ranks share the cores (each rank gets cores / ranks threads) and every layer adds
two all-reduces over gloo loopback, so expect TP > 1 to be *slower* here: TP buys memory and
bandwidth across devices, which one CPU does not have. The numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from workbench.bench.harness import engine_parser, progress
from workbench.bench.prompts import repeated_text_prompt


def add_parser(bench_sub) -> None:
    p = engine_parser(
        bench_sub,
        "tp",
        help="latency at several --tp-size values",
        description="latency at several --tp-size values (printed, not asserted)",
    )
    p.add_argument(
        "--tp-sizes",
        type=int,
        nargs="+",
        default=[1, 3],
        help="TP sizes to compare (each must divide the model's heads; default model: 1 3 9)",
    )
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(func=lambda a: 0 if run_tp_bench(a) else 1)


def run_tp_bench(args: argparse.Namespace) -> list[dict]:
    """Run the comparison; returns one row per TP size (also printed as a table)."""
    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine

    names = {f.name for f in dataclasses.fields(ServerArgs)}
    base = ServerArgs(**{k: v for k, v in vars(args).items() if k in names})
    sp = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    rows = []
    for tp in args.tp_sizes:
        progress(f"tp_size {tp}: starting")
        t0 = time.monotonic()
        with Engine(server_args=dataclasses.replace(base, tp_size=tp, dist_init_addr=None)) as engine:
            ready_s = time.monotonic() - t0
            engine.generate(
                input_ids=repeated_text_prompt(engine.tokenizer, args.prompt_len, -1), sampling_params=sp
            )  # warm-up
            ttfts, tpots = [], []
            for i in range(args.repeats):
                # A fresh prompt each time: no radix-cache hit flatters TTFT.
                out = engine.generate(
                    input_ids=repeated_text_prompt(engine.tokenizer, args.prompt_len, i), sampling_params=sp
                )
                m = out["meta_info"]
                ttfts.append(m["ttft"])
                tpots.append((m["e2e_latency"] - m["ttft"]) / max(1, m["completion_tokens"] - 1))
            prompts = [repeated_text_prompt(engine.tokenizer, args.prompt_len, 1000 + i) for i in range(args.batch)]
            t1 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=sp)
            batch_s = time.perf_counter() - t1
            tokens = sum(len(o["output_ids"]) for o in outs)
            rows.append(
                {
                    "tp_size": tp,
                    "ready_s": ready_s,
                    "ttft_ms": 1000 * statistics.median(ttfts),
                    "tpot_ms": 1000 * statistics.median(tpots),
                    "batch": args.batch,
                    "batch_s": batch_s,
                    "batch_tok_s": tokens / batch_s,
                    "dtype": engine.scheduler_info.get("dtype"),
                }
            )
    _print(rows, args)
    return rows


def _print(rows: list[dict], args) -> None:
    print(f"\nprompt {args.prompt_len} tokens, {args.new_tokens} new tokens (greedy), batch {args.batch}")
    print(f"{'tp':>3} {'dtype':>9} {'ready s':>8} {'TTFT ms':>8} {'TPOT ms':>8} {'batch s':>8} {'batch tok/s':>11}")
    for r in rows:
        print(
            f"{r['tp_size']:>3} {r['dtype']:>9} {r['ready_s']:>8.1f} {r['ttft_ms']:>8.1f} {r['tpot_ms']:>8.1f} "
            f"{r['batch_s']:>8.2f} {r['batch_tok_s']:>11.1f}"
        )
    if rows and rows[0]["tp_size"] == 1:
        for r in rows[1:]:
            print(
                f"tp {r['tp_size']} vs tp 1: TPOT x{r['tpot_ms'] / rows[0]['tpot_ms']:.2f}, "
                f"batch throughput x{r['batch_tok_s'] / rows[0]['batch_tok_s']:.2f}"
            )
