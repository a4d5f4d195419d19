"""`workbench bench spec`: decode speed with and without speculative decoding (NGRAM, or STANDALONE
with a draft model: `--speculative-algorithm STANDALONE --speculative-draft-model-path DIR`), issue #18.

Two persistent engines on the same model and threads, one plain and one with
`--speculative-algorithm NGRAM`, decode the same prompts greedily (EOS ignored, so both do exactly
the same tokens; greedy output is equal either way, and the bench checks it), in interleaved rounds
(plain, NGRAM, NGRAM, plain, ...) so machine noise lands on both alike. Two workloads:

- repetitive: copying and editing a given text or code (NGRAM's drafts come from the prompt);
- chat: free-form questions (little to draft from).

Decode tok/s is (N - 1) tokens per request over the time of an N-token run minus a 1-token run
(prefill excluded). Beside it, the accept length (tokens a request gains per verify step, from the
engine's counters over the measured runs) and the load average. On a CPU a verify pass of 1 + k
tokens costs more than a decode step of one, so speculation pays only when enough drafts stand:
the figures say where that is.
"""

from __future__ import annotations

import argparse
import statistics
import time

from workbench.bench.harness import engine_parser, load_text, progress

WORKLOADS = {
    "repetitive": [
        "Repeat this text exactly, word for word: The radix cache keeps the key-value tensors of every "
        "prompt prefix it has seen, so a request that starts the same way reuses them instead of "
        "computing them again. When the pool runs short, the least recently used leaves are evicted.",
        "Rewrite this Python code with the variable `total` renamed to `acc`, changing nothing else:\n"
        "def sum_list(xs):\n    total = 0\n    for x in xs:\n        total = total + x\n    return total\n\n"
        "def mean(xs):\n    total = sum_list(xs)\n    return total / len(xs)\n",
        "Copy the following list, keeping every line: apples, pears, plums, cherries, apples, pears, "
        "plums, cherries, apples, pears, plums, cherries, apples, pears, plums, cherries.",
        "Say this sentence three times: the scheduler admits, the model computes, the detokenizer streams.",
    ],
    "chat": [
        "What is the capital of France, and why is it famous?",
        "Give me three tips for learning to cook.",
        "Why is the sky blue? Answer briefly.",
        "Write a short poem about autumn leaves.",
    ],
}


def _chat(engine, text: str) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": text}])


def _timed(engine, ids: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=sp)
    return time.perf_counter() - t0, [o["output_ids"] for o in outs]


def _decode_tps(engine, ids: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    t1, _ = _timed(engine, ids, 1)
    tn, out = _timed(engine, ids, new)
    return len(ids) * (new - 1) / max(tn - t1, 1e-9), out


def _counters(engine) -> tuple[int, int, int]:
    s = engine.get_internal_state()
    return s.get("spec_verified", 0), s.get("spec_proposed", 0), s.get("spec_accepted", 0)


def run_spec_bench(args: argparse.Namespace) -> dict:
    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine

    base = ServerArgs.from_cli_args(args)
    algo = base.speculative_algorithm or "NGRAM"  # STANDALONE with --speculative-draft-model-path DIR
    plain_args = base.replace(show_progress=False, speculative_algorithm=None, speculative_draft_model_path=None)
    spec_args = base.replace(show_progress=False, speculative_algorithm=algo)
    new = 8 if args.quick else args.new
    batches = (1,) if args.quick else tuple(int(b) for b in args.batches.split(","))
    rounds = 1 if args.quick else args.rounds
    loads = [load_text()]
    rows = []
    progress(f"starting a plain engine and an {algo} engine on the same model")
    with Engine(server_args=plain_args) as plain, Engine(server_args=spec_args) as spec:
        engines = {"plain": plain, algo: spec}
        for name, texts in WORKLOADS.items():
            ids = [_chat(plain, t) for t in texts]
            for b in batches:
                batch = (ids * ((b + len(ids) - 1) // len(ids)))[:b]
                tps = {"plain": [], algo: []}
                v0, p0, a0 = _counters(spec)
                same = True
                for r in range(rounds):
                    order = ("plain", algo, algo, "plain") if r % 2 == 0 else (algo, "plain", "plain", algo)
                    outs = {}
                    for which in order:
                        progress(f"{name}, batch {b}, round {r + 1}/{rounds}: {which}")
                        t, outs[which] = _decode_tps(engines[which], batch, new)
                        tps[which].append(t)
                    same = same and outs["plain"] == outs[algo]
                    loads.append(load_text())
                v1, p1, a1 = _counters(spec)
                verified, proposed, accepted = v1 - v0, p1 - p0, a1 - a0
                rows.append(
                    dict(
                        workload=name,
                        batch=b,
                        plain=statistics.median(tps["plain"]),
                        spec=statistics.median(tps[algo]),
                        runs=tps,
                        accept_length=(accepted + verified) / verified if verified else 1.0,
                        kept=f"{accepted}/{proposed}",
                        same=same,
                    )
                )
    print(
        f"\nspeculative decoding, {algo} ({spec_args.resolved_num_draft_tokens()} drafts at most) vs plain decode: "
        f"greedy, EOS ignored, {new} new tokens, decode tok/s (prefill excluded), A B B A x {rounds}, medians; "
        f"threads {plain_args.num_threads or 'default'}; load average {' → '.join(loads)}"
    )
    print(
        f"{'workload':<11} {'batch':>5} {'plain tok/s':>12} {algo + ' tok/s':>16} {'ratio':>7} "
        f"{'accept len':>11} {'drafts kept':>12} {'same tokens':>12}"
    )
    for r in rows:
        ratio = r["spec"] / r["plain"] if r["plain"] else 0.0
        print(
            f"{r['workload']:<11} {r['batch']:>5} {r['plain']:>12.1f} {r['spec']:>16.1f} {ratio:>6.2f}× "
            f"{r['accept_length']:>11.2f} {r['kept']:>12} {'yes' if r['same'] else 'NO':>12}"
        )
    print(
        f"accept length: tokens a request gains per verify step (1 + drafts kept), over the {algo} runs above; "
        "a verify pass of 1 + k tokens costs more than one decode step, so a ratio below 1 means it did not pay"
    )
    return {"rows": rows}


def add_parser(bench_sub) -> None:
    p = engine_parser(
        bench_sub,
        "spec",
        help="decode tok/s with and without speculative decoding (NGRAM, or STANDALONE with "
        "--speculative-algorithm STANDALONE --speculative-draft-model-path DIR), repetitive and chat workloads",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each runs both engines twice)")
    p.add_argument("--new", type=int, default=128, help="new tokens per request")
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.set_defaults(func=lambda a: 0 if run_spec_bench(a)["rows"] else 1)
