"""`workbench bench deterministic`: what --enable-deterministic-inference costs (issue #43).

Two persistent engines on the same model and threads, one plain and one with
`--enable-deterministic-inference`, measured in interleaved rounds (plain, deterministic,
deterministic, plain, ...) so machine noise lands on both alike:

- prefill tok/s: a batch of prompts of --prompt-len tokens with max_new_tokens 1 (the radix cache is
  flushed before each run, so every prompt token is computed);
- decode tok/s: greedy, EOS ignored, (N - 1) tokens per request over the time of an N-token run minus
  a 1-token run (prefill excluded), at batch 1 and at --batch.

Beside the speeds it checks what the flag promises: the first prompt's greedy tokens and logprobs
alone and inside the batch, on each engine (bitwise). The CPU model and the load average are printed
with the table: timings on a shared machine move with its load.
"""

from __future__ import annotations

import argparse
import statistics
import time

from workbench.bench.harness import engine_parser, interleave, load_text, progress

PROMPTS = [
    "Explain how a radix tree stores shared prefixes of strings, with an example.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five differences between a process and a thread.",
    "What causes the seasons on Earth?",
    "Describe the water cycle in a few sentences.",
    "Give a recipe for a simple tomato soup.",
    "Why do batteries lose capacity over time?",
    "Summarize the rules of chess in one paragraph.",
]


def _ids(engine, batch: int) -> list[list[int]]:
    ids = [engine.apply_chat_template([{"role": "user", "content": t}]) for t in PROMPTS]
    return (ids * ((batch + len(ids) - 1) // len(ids)))[:batch]


def _long_ids(engine, length: int, batch: int) -> list[list[int]]:
    """`batch` prompts of `length` tokens that differ in their first token (no shared prefix to reuse)."""
    base = engine.tokenizer.encode(" ".join(PROMPTS * 20))
    base = (base * (length // max(1, len(base)) + 1))[:length]
    return [[1000 + i] + base[1:] for i in range(batch)]


def _generate(engine, ids, new: int, logprob: bool = False):
    sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    return engine.generate(input_ids=ids, sampling_params=sp, return_logprob=logprob)


def _timed(engine, ids, new: int) -> float:
    t0 = time.perf_counter()
    _generate(engine, ids, new)
    return time.perf_counter() - t0


def _decode_tps(engine, ids, new: int) -> float:
    """NaN when noise made the N-token run no slower than the 1-token one (a loaded machine)."""
    t1 = _timed(engine, ids, 1)
    tn = _timed(engine, ids, new)
    return len(ids) * (new - 1) / (tn - t1) if tn > t1 else float("nan")


def _prefill_tps(engine, ids) -> float:
    engine.flush_cache()
    return sum(len(i) for i in ids) / max(_timed(engine, ids, 1), 1e-9)


def _invariant(engine, ids, new: int) -> bool:
    """The first prompt's greedy tokens and logprobs, alone and first in the batch: bitwise equal?"""
    engine.flush_cache()
    alone = _generate(engine, ids[:1], new, logprob=True)[0]
    engine.flush_cache()
    inside = _generate(engine, ids, new, logprob=True)[0]
    lp = [t[0] for t in alone["meta_info"]["output_token_logprobs"]]
    lp_in = [t[0] for t in inside["meta_info"]["output_token_logprobs"]]
    return alone["output_ids"] == inside["output_ids"] and lp == lp_in


def _median(values: list[float]) -> float:
    kept = [v for v in values if v == v]
    return statistics.median(kept) if kept else float("nan")


def run_deterministic_bench(args: argparse.Namespace) -> dict:
    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine
    from workbench.core.simulation.calibration import cpu_model

    base = ServerArgs.from_cli_args(args).replace(show_progress=False)
    plain_args = base.replace(enable_deterministic_inference=False)
    det_args = base.replace(enable_deterministic_inference=True)
    quick = args.quick
    new = 16 if quick else args.new
    batch = 4 if quick else args.batch
    prompt_len = 64 if quick else args.prompt_len
    rounds = 1 if quick else args.rounds
    loads = [load_text()]
    names = ("plain", "deterministic")
    progress("starting a plain engine and a --enable-deterministic-inference engine on the same model")
    with Engine(server_args=plain_args) as plain, Engine(server_args=det_args) as det:
        engines = dict(zip(names, (plain, det)))
        chat = _ids(plain, batch)
        long = _long_ids(plain, prompt_len, batch)
        progress("warming both engines up on the measured shapes")
        for e in engines.values():
            _prefill_tps(e, long)
            _timed(e, chat, new)
        rows = []
        for label, fn in (
            (f"prefill, {batch} x {prompt_len} tokens", lambda e: _prefill_tps(e, long)),
            ("decode, batch 1", lambda e: _decode_tps(e, chat[:1], new)),
            (f"decode, batch {batch}", lambda e: _decode_tps(e, chat, new)),
        ):
            progress(f"{label}: A B B A x {rounds}")
            got = interleave({n: (lambda e=engines[n], f=fn: f(e)) for n in names}, rounds)
            loads.append(load_text())
            rows.append((label, _median(got.samples["plain"]), _median(got.samples["deterministic"])))
        progress("checking the first prompt alone and inside the batch on each engine")
        same = {n: _invariant(engines[n], chat, new) for n in names}
    print(
        f"\n--enable-deterministic-inference vs plain: greedy, EOS ignored, {new} new tokens, tok/s medians of "
        f"A B B A x {rounds}; threads {base.num_threads or 'default'}, dtype {base.dtype}"
    )
    print(f"CPU: {cpu_model() or 'unknown'}; load average {' → '.join(loads)}")
    print(f"{'':<28} {'plain tok/s':>12} {'deterministic':>14} {'ratio':>7}")
    for label, a, b in rows:
        print(f"{label:<28} {a:>12.1f} {b:>14.1f} {b / a if a == a and a > 0 else float('nan'):>6.2f}×")
    print(
        "first prompt alone vs in the batch, tokens and logprobs bitwise: "
        + ", ".join(f"{n} {'same' if same[n] else 'DIFFERENT'}" for n in names)
    )
    return {"rows": rows, "same": same}


def add_parser(bench_sub) -> None:
    p = engine_parser(
        bench_sub,
        "deterministic",
        help="prefill and decode tok/s with and without --enable-deterministic-inference, and whether a "
        "prompt's outputs are the same alone and in a batch",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each runs both engines twice)")
    p.add_argument("--new", type=int, default=64, help="new tokens per request in the decode runs")
    p.add_argument("--batch", type=int, default=8, help="the batch size of the batched runs")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per request in the prefill run")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke test)")
    p.set_defaults(func=lambda a: 0 if run_deterministic_bench(a)["rows"] else 1)
