"""`workbench bench model`: the model executor's tokens/s beside transformers' `generate`.

Three measurements per dtype, each taken for both engines in the same process
on the same weights and the same token ids, alternating engine by engine so
that noise from other processes hits both alike:

- decode bs=1: one request; decode tokens/s, prefill excluded.
- decode bs=N (32): N requests of equal prompt length; for transformers a static
  batch (no padding needed), for the workbench one continuous batch.
- prefill P (512): one P-token prompt, time to its first token.

Both engines stamp the end of every token step (the workbench at each sampling
call, transformers through a stopping criterion, which `generate` calls once per
token): decode is first token -> last token, n - 1 steps with sampling, prefill
excluded; prefill is start -> first token. Each timing is the best of
`--repeats`, the engines alternating within a repeat. Greedy decoding, EOS
ignored, so both engines run exactly the requested number of steps. On a shared machine the numbers move with other processes' load;
compare the ratios of one run.

Every row also prints its GEMM GFLOP/s: the linears' FLOPs (from the model's shapes and the
tokens processed) over the measured time, and that as a share of this machine's compute peak for
the dtype and threads (`workbench bench peak`, measured once per machine and cached). For batched
decode on CPU it adds a diagnostic, "linears alone": the batch's tokens over the time of one step's
linear layers alone (the workbench's own packed weights, chained as in a step, nothing else): how
much of a step our GEMM path takes, not a bound (a faster GEMM passes it).

`--profile` instead splits each step's time by component (GEMMs, attention, norms + rope, ...) and
a real Engine's decode step by scheduler phase; see workbench/bench/profile_bench.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

from workbench.bench import profile_bench
from workbench.bench.gemm_work import LinearShapes
from workbench.bench.harness import Stages, busy_warning
from workbench.bench.model_engines import (
    CLOCKS,
    BenchSizes,
    TransformersModel,
    WorkbenchModel,
    environment,
    parse_dtypes,
    set_clock,
    synced_wall,
)
from workbench.bench.peak import fraction_text, gemm_text, get_peak, peak_gflops, peak_note
from workbench.bench.prompts import torch_random_ids


@dataclass
class Row:
    """One line of the result table."""

    metric: str  # "decode bs=1", "decode bs=32", "prefill 512"
    dtype: str
    workbench_tok_s: float
    transformers_tok_s: float | None  # None with --no-reference
    ratio: float | None  # workbench / transformers
    detail: str = ""
    # Batched decode on CPU: tokens/s if a step cost only its linear layers (the same packed weights,
    # chained as in one step, nothing else): a diagnostic of our GEMM path, not a bound.
    linears_only_tok_s: float | None = None
    # the linears' FLOPs at each side's tok/s (model shapes x tokens), and the machine's compute peak
    # for the dtype on the threads used (`workbench bench peak`)
    gemm_gflops: float | None = None
    transformers_gemm_gflops: float | None = None
    peak_gflops: float | None = None
    threads: int | None = None


def _measure(engines: list, bs: int, sizes: BenchSizes, one, many, long_prompt) -> dict[str, float]:
    """tokens/s per engine for one metric (bs 0 = prefill); engines alternate within each repeat
    so a burst of load from other processes does not land on one engine only.

    Each engine stamps the end of every token step: prefill is start -> first token
    (time to first token), decode is first token -> last token (n - 1 steps,
    sampling included). The best of the repeats is kept.
    """
    best = {e.name: float("inf") for e in engines}
    n = sizes.decode_tokens_bs1 if bs == 1 else sizes.decode_tokens_batch
    for _ in range(max(1, sizes.repeats)):
        for e in engines:
            if bs == 0:
                stamps = e.generate([long_prompt], 1)
                best[e.name] = min(best[e.name], stamps[1] - stamps[0])
            else:
                stamps = e.generate(one if bs == 1 else many, n)
                if len(stamps) != n + 1:
                    raise RuntimeError(f"{e.name}: {len(stamps) - 1} token steps for {n} tokens")
                best[e.name] = min(best[e.name], stamps[-1] - stamps[1])
    if bs == 0:
        return {name: len(long_prompt) / t for name, t in best.items()}
    return {name: bs * (n - 1) / max(t, 1e-9) for name, t in best.items()}


# ---- the benchmark ------------------------------------------------------------------
def run_model_bench(args: argparse.Namespace) -> list[Row]:
    """Run the benchmark described by parsed `bench model` arguments; returns the table rows."""
    from workbench.core.model_loader import prepare_model

    sizes = BenchSizes.quick() if args.quick else BenchSizes()
    for name in ("batch", "prefill_len", "repeats"):
        if getattr(args, name, None):
            setattr(sizes, name, getattr(args, name))
    if getattr(args, "decode_tokens", None):
        sizes.decode_tokens_bs1 = sizes.decode_tokens_batch = args.decode_tokens
    if min(sizes.decode_tokens_bs1, sizes.decode_tokens_batch) < 2:
        raise ValueError("--decode-tokens must be at least 2 (one prefill token plus decode steps)")
    dtypes = parse_dtypes(args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = CLOCKS[getattr(args, "clock", None) or "wall"]
    device = getattr(args, "device", None) or "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda but torch sees no CUDA GPU; leave --device out to run on CPU")
        if clock is not time.perf_counter:
            raise ValueError(
                "--clock cpu measures process CPU time, which says nothing about a GPU; "
                "use the default wall clock with --device cuda"
            )
        clock = synced_wall
    set_clock(clock)
    reference = not args.no_reference
    quiet = bool(getattr(args, "quiet", False))

    metrics = [("decode bs=1", 1), (f"decode bs={sizes.batch}", sizes.batch), (f"prefill {sizes.prefill_len}", 0)]
    engines_per_dtype = 2 if reference else 1
    stages = Stages(total=len(dtypes) * engines_per_dtype * (1 + len(metrics)), quiet=quiet)
    busy = busy_warning()
    if busy and not quiet:
        print(busy, file=sys.stderr, flush=True)
    prepared = prepare_model(args.model, progress=not quiet)
    vocab = int(prepared.config.vocab_size)
    max_tokens = (
        max(
            sizes.batch * (sizes.prompt_len + sizes.decode_tokens_batch),
            sizes.prompt_len + sizes.decode_tokens_bs1,
            sizes.prefill_len + 1,
        )
        + 64
    )
    one = torch_random_ids(1, sizes.prompt_len, vocab, seed=1)
    many = torch_random_ids(sizes.batch, sizes.prompt_len, vocab, seed=2)
    long_prompt = torch_random_ids(1, sizes.prefill_len, vocab, seed=3)[0]

    rows: list[Row] = []
    shapes = LinearShapes.from_config(prepared.config)
    threads = torch.get_num_threads()
    peak = get_peak(quiet=quiet) if device == "cpu" else None
    for dtype in dtypes:
        engines = []
        t = time.perf_counter()
        engines.append(
            WorkbenchModel(
                prepared,
                dtype,
                max_tokens,
                bool(getattr(args, "enable_torch_compile", False)),
                device,
                bool(getattr(args, "disable_cuda_graph", False)),
            )
        )
        stages.step(f"{dtype}: workbench loaded ({time.perf_counter() - t:.1f}s)")
        if reference:
            t = time.perf_counter()
            engines.append(TransformersModel(prepared, dtype, device))
            stages.step(f"{dtype}: transformers loaded ({time.perf_counter() - t:.1f}s)")
        # Warm-up at the measured batch sizes: one-time set-up (oneDNN kernel creation,
        # torch.compile graphs) stays out of the timings.
        for e in engines:
            e.generate(one, 2)
            e.generate(many, 2)
            compiled = getattr(e, "compile_times", lambda: {})()
            if compiled:
                stages.note(
                    f"{dtype}: compiled decode buckets "
                    + ", ".join(f"bs={b}: {s:.1f}s" for b, s in sorted(compiled.items()))
                )
        for metric, bs in metrics:
            rates = _measure(engines, bs, sizes, one, many, long_prompt)
            for name, rate in rates.items():
                stages.step(f"{dtype}: {name:<12} {metric:<14} {rate:8.1f} tok/s")
            ref = rates.get("transformers")
            wb = rates["workbench"]
            if bs == 0:
                detail = f"{sizes.prefill_len}-token prompt, time to first token"
            else:
                n = sizes.decode_tokens_bs1 if bs == 1 else sizes.decode_tokens_batch
                detail = f"{n} new tokens after {sizes.prompt_len}-token prompts"
            linears_only = None
            if bs > 1:
                step_s = engines[0].linears_step_seconds(bs, sizes.repeats)
                linears_only = bs / step_s if step_s else None
            per_token = gemm_flops_per_token(shapes, bs, sizes.prefill_len)
            rows.append(
                Row(
                    metric,
                    dtype,
                    wb,
                    ref,
                    (wb / ref) if ref else None,
                    detail,
                    linears_only,
                    wb * per_token / 1e9,
                    ref * per_token / 1e9 if ref else None,
                    peak_gflops(peak, dtype, threads),
                    threads,
                )
            )
        del engines
    return rows


def gemm_flops_per_token(shapes: LinearShapes, bs: int, prefill_len: int) -> float:
    """The linears' FLOPs per token of a metric: a decode token goes through every linear and the LM
    head; a prefill (bs 0) token through the layers' linears, plus one LM-head row for the prompt."""
    body, head = shapes.body_flops_per_token(), shapes.head_flops_per_token()
    return body + head if bs else body + head / max(1, prefill_len)


# ---- eager vs compiled decode ------------------------------------------------------------
@dataclass
class CompileRow:
    """One batch size: the workbench's decode tokens/s eager and through its compiled step."""

    batch: int
    dtype: str
    eager_tok_s: float
    compiled_tok_s: float
    compile_s: float  # one-time compile of this batch size's graph

    @property
    def ratio(self) -> float:
        return self.compiled_tok_s / self.eager_tok_s


def run_compile_bench(args: argparse.Namespace) -> list[CompileRow]:
    """Eager vs `--enable-torch-compile` decode (the CPU analogue of CUDA graphs), same weights,
    same prompts, the two runners alternating within each repeat; best of the repeats kept."""
    from workbench.core.model_loader import prepare_model

    batches = sorted({int(b) for b in str(args.batches).split(",") if b.strip()})
    if not batches or batches[0] < 1:
        raise ValueError("--batches takes positive batch sizes, e.g. 1,8,32")
    sizes = BenchSizes.quick() if args.quick else BenchSizes()
    new_tokens = getattr(args, "decode_tokens", None) or (4 if args.quick else 16)
    if new_tokens < 2:
        raise ValueError("--decode-tokens must be at least 2 (one prefill token plus decode steps)")
    repeats = getattr(args, "repeats", None) or sizes.repeats
    dtypes = parse_dtypes(args.dtype) if args.dtype else ["float32"]
    if args.threads:
        torch.set_num_threads(args.threads)
    set_clock(CLOCKS[getattr(args, "clock", None) or "wall"])
    stages = Stages(total=len(dtypes) * (2 + 2 * len(batches)), quiet=bool(getattr(args, "quiet", False)))
    prepared = prepare_model(args.model, progress=not stages.quiet)
    vocab = int(prepared.config.vocab_size)
    prompts = {bs: torch_random_ids(bs, sizes.prompt_len, vocab, seed=10 + bs) for bs in batches}
    max_tokens = batches[-1] * (sizes.prompt_len + new_tokens) + 64
    rows = []
    for dtype in dtypes:
        eager = WorkbenchModel(prepared, dtype, max_tokens, False)
        stages.step(f"{dtype}: eager runner loaded")
        compiled = WorkbenchModel(prepared, dtype, max_tokens, True)
        compiled.runner.decode_runner.buckets = batches  # compile exactly the measured sizes
        stages.step(f"{dtype}: compiled runner loaded")
        for bs in batches:  # warm-up: oneDNN kernels for eager; the compile itself for the other
            eager.generate(prompts[bs], 2)
            compiled.generate(prompts[bs], 2)
            stages.step(f"{dtype}: bs={bs} compiled in {compiled.compile_times().get(bs, 0.0):.1f}s")
        best = {(bs, name): float("inf") for bs in batches for name in ("eager", "compiled")}
        for _ in range(max(1, repeats)):
            for bs in batches:
                for name, engine in (("eager", eager), ("compiled", compiled)):
                    stamps = engine.generate(prompts[bs], new_tokens)
                    best[bs, name] = min(best[bs, name], stamps[-1] - stamps[1])
        for bs in batches:
            rate = {n: bs * (new_tokens - 1) / max(best[bs, n], 1e-9) for n in ("eager", "compiled")}
            rows.append(CompileRow(bs, dtype, rate["eager"], rate["compiled"], compiled.compile_times().get(bs, 0.0)))
            stages.step(f"{dtype}: bs={bs} eager {rate['eager']:.1f} tok/s, compiled {rate['compiled']:.1f} tok/s")
        del eager, compiled
    return rows


def format_compile_table(rows: list[CompileRow]) -> str:
    header = f"{'decode':<10}{'dtype':<10}{'eager tok/s':>13}{'compiled tok/s':>16}{'ratio':>8}{'compile s':>11}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{'bs=' + str(r.batch):<10}{r.dtype:<10}{r.eager_tok_s:>13.1f}{r.compiled_tok_s:>16.1f}"
            f"{r.ratio:>7.2f}x{r.compile_s:>11.1f}"
        )
    return "\n".join(lines)


def format_table(rows: list[Row], peak=None) -> str:
    """The rows as a text table; `peak` (a `Peak`) adds the line saying what the % of peak is of."""
    header = (
        f"{'metric':<16}{'dtype':<10}{'workbench tok/s':>17}{'transformers tok/s':>20}{'ratio':>9}"
        f"{'GEMM GFLOP/s (% of peak)':>26}{'transformers % of peak':>24}{'linears alone tok/s':>21}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        ref = f"{r.transformers_tok_s:.1f}" if r.transformers_tok_s else "-"
        ratio = f"{r.ratio:.2f}x" if r.ratio else "-"
        alone = f"{r.linears_only_tok_s:.1f}" if r.linears_only_tok_s else "-"
        lines.append(
            f"{r.metric:<16}{r.dtype:<10}{r.workbench_tok_s:>17.1f}{ref:>20}{ratio:>9}"
            f"{gemm_text(r.gemm_gflops, r.peak_gflops):>26}"
            f"{fraction_text(r.transformers_gemm_gflops, r.peak_gflops):>24}{alone:>21}"
        )
    pairs = sorted({(r.dtype, r.threads) for r in rows if r.peak_gflops}, key=str)
    if peak is not None and pairs:
        lines.append(peak_note(peak, pairs))
    if any(r.linears_only_tok_s for r in rows):
        lines.append(
            "linears alone: the batch's tokens over the time of one step's linear layers alone "
            "(same packed weights, chained, nothing else): a diagnostic of our GEMM path, not a bound."
        )
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `model` on a `bench` subcommand's subparsers; the handler is `args.func(args)`."""
    p = subparsers.add_parser(
        "model",
        help="model executor tokens/s vs transformers (decode bs=1/32, prefill)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=_cli_main)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model path (.gguf, HF dir); default SmolLM2-135M-Instruct")
    p.add_argument(
        "--dtype",
        default=None,
        help="comma-separated dtypes to measure (default: float32,bfloat16; float32 with --compare-compile)",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test, numbers meaningless)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write rows + environment as JSON")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--batch", type=int, default=None, help="batched decode size (default 32)")
    p.add_argument("--decode-tokens", type=int, default=None, help="new tokens per decode run")
    p.add_argument("--prefill-len", type=int, default=None, help="prefill prompt length (default 512)")
    p.add_argument("--repeats", type=int, default=None, help="timings per measurement, best kept (default 2)")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall (default) or cpu: process CPU time, steadier on a busy machine; "
        "meaningful with --threads 1 (more threads add up their CPU time)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip transformers (workbench numbers only)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where both engines run (default cpu; cuda times with a device sync per step)",
    )
    p.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="with --device cuda: the workbench decodes eagerly (to see what graphs buy)",
    )
    p.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="run decode steps through torch.compile (compiles per batch-size bucket first)",
    )
    p.add_argument(
        "--compare-compile",
        action="store_true",
        help="instead: eager vs torch.compile'd decode steps of the workbench itself, "
        "at the --batches sizes (compiles one graph per size first)",
    )
    p.add_argument("--batches", default="1,8,32", help="batch sizes for --compare-compile (default 1,8,32)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead: where a step's time goes (GEMMs, attention, norms+rope, activation, sampling, "
        "embedding, other, host), decode bs=1 / bs=--batch and one extend, per dtype; then a real "
        "Engine's scheduler split (see workbench/bench/profile_bench.py)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        help="with --profile: decode steps per measurement (default 16; 3 with --quick)",
    )
    p.add_argument(
        "--no-engine-split",
        action="store_true",
        help="with --profile: skip the real Engine's schedule/forward/rest split",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _cli_main(args: argparse.Namespace) -> int:
    if getattr(args, "profile", False):
        return profile_bench.cli_main(args)
    if getattr(args, "compare_compile", False):
        key, rows = "compile_rows", run_compile_bench(args)
        print(format_compile_table(rows))
    else:
        key, rows = "rows", run_model_bench(args)
        device = getattr(args, "device", None) or "cpu"
        print(format_table(rows, get_peak(quiet=True) if device == "cpu" else None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {key: [asdict(r) for r in rows], "environment": environment(), "quick": bool(args.quick)}, f, indent=2
            )
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m workbench.bench.model_bench [options]`."""
    p = argparse.ArgumentParser(
        prog="workbench bench model", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return _cli_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
