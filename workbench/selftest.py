"""`workbench selftest --device cuda|cpu`: every execution path against torch-native, as a pass/fail table.

For a person with a GPU, one command checks what this project's CPU-only CI cannot:
each attention backend and decode through CUDA graphs produce the same greedy tokens
as the torch-native backend run eagerly on the real default model, and the overlap
loop the same tokens as the normal loop. Each row has its time.

`--device cpu` is the dry run that CI executes: graphs through the stand-in
mechanism (the runner's whole flow, minus the real capture), triton kernels under
Triton's interpreter on the model's head shapes (a subprocess with
`TRITON_INTERPRET=1`; a whole 30-layer model would take too long interpreted), and
flashinfer reported as skipped (CUDA only).

Token comparison: identical greedy tokens pass. In bfloat16 (the CUDA default, and
flashinfer's only precision here) two correct kernels can legitimately pick
different tokens where the top two candidates are within rounding; a divergence
passes only at such a near-tie (the reference's own top-2 gap below
`NEAR_TIE_NATS`) and is reported as such.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

NEAR_TIE_NATS = 0.05
PROMPT_TEXTS = ["What is a radix tree?", "Write a haiku about the sea.", "Name three prime numbers."]
NEW_TOKENS = (16, 10, 5)  # different lengths: the decode batch shrinks 3 -> 2 -> 1
QUICK_NEW_TOKENS = (5, 3, 2)
CHECKS = ("reference", "cuda_graph", "triton", "flashinfer", "overlap")


@dataclass
class CheckResult:
    name: str
    status: str  # PASS | FAIL | SKIP
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Greedy:
    """Greedy continuations with each step's top-2 logprobs (for the near-tie rule)."""

    tokens: list[list[int]]
    top2: list[list[list[tuple[int, float]]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def compare_greedy(ref: Greedy, out: Greedy, near_tie: float = NEAR_TIE_NATS) -> tuple[bool, str]:
    """(passed, detail): equal tokens, or divergence only at near-ties of the reference."""
    if len(ref.tokens) != len(out.tokens):
        return False, f"{len(out.tokens)} requests, expected {len(ref.tokens)}"
    ties = 0
    for i, (a, b) in enumerate(zip(ref.tokens, out.tokens)):
        if a == b:
            continue
        if len(a) != len(b):
            return False, f"request {i}: {len(b)} tokens, expected {len(a)}"
        j = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        # After a legitimate divergence the two continuations are different texts: compare no further.
        cands = dict(ref.top2[i][j]) if ref.top2 else {}
        if b[j] in cands and a[j] in cands and abs(cands[a[j]] - cands[b[j]]) < near_tie:
            ties += 1
            continue
        return False, f"request {i} diverges at token {j}: {b[j]} instead of {a[j]}"
    return True, "tokens equal" if ties == 0 else f"equal up to {ties} near-tie divergence(s)"


# ---- running the model ------------------------------------------------------------------------
class _Bench:
    """The default model prepared once, prompts tokenized with its chat template."""

    def __init__(self, device: str, dtype: str, model: str | None, new_tokens: tuple[int, ...] = NEW_TOKENS):
        from workbench.core.model_loader import load_tokenizer, prepare_model

        self.device, self.dtype, self.model = device, dtype, model
        self.new_tokens = new_tokens
        self.reference_runner = None
        self.prepared = prepare_model(model, progress=False)
        tok = load_tokenizer(self.prepared.model_dir)
        self.prompts = []
        for text in PROMPT_TEXTS:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            self.prompts.append(list(ids["input_ids"] if not isinstance(ids, list) else ids))

    def runner(self, **server_args):
        from workbench.core.args import ServerArgs
        from workbench.core.model_executor.model_runner import ModelRunner

        args = dict(
            device=self.device, dtype=self.dtype, max_total_tokens=4096, max_running_requests=8, show_progress=False
        )
        args.update(server_args)
        return ModelRunner(ServerArgs(**args), prepared=self.prepared)

    def greedy(self, runner) -> Greedy:
        from workbench.core.model_executor.offline_harness import OfflineHarness
        from workbench.core.sampling.sampling_params import SamplingParams

        params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in self.new_tokens]
        halves = [len(p) // 2 for p in self.prompts]  # a cached prefix, then the extension
        res = OfflineHarness(runner).generate(
            self.prompts, params, prefix_lens=halves, return_logprob=True, top_logprobs_num=2
        )
        return Greedy([r.output_ids for r in res], [r.top_logprobs for r in res])


def _timed(name: str, fn: Callable[[], tuple[str, str]]) -> CheckResult:
    t0 = time.perf_counter()
    try:
        status, detail = fn()
    except Exception as exc:  # a failing path is a FAIL row, never a crash of the whole table
        status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
    return CheckResult(name, status, time.perf_counter() - t0, detail)


def _verdict(ref: Greedy, out: Greedy, extra: str = "") -> tuple[str, str]:
    ok, detail = compare_greedy(ref, out)
    return ("PASS" if ok else "FAIL"), detail + (f"; {extra}" if extra else "")


def _replays(graph_runner) -> str:
    return "replays " + " ".join(f"bs{b}={n}" for b, n in sorted(graph_runner.replay_count.items()) if n)


# ---- the checks ---------------------------------------------------------------------------------
def run_selftest(
    device: str,
    dtype: str | None = None,
    model: str | None = None,
    checks: list[str] | None = None,
    progress: bool = True,
    quick: bool = False,
) -> list[CheckResult]:
    """Run the checks for `device` ("cpu" or "cuda"); returns one CheckResult per row.

    `quick` generates fewer tokens (the batch still shrinks through every bucket)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda but torch sees no CUDA GPU (torch.cuda.is_available() is False); "
            "run `workbench selftest --device cpu` for the CPU dry run"
        )
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    wanted = list(checks or CHECKS)
    unknown = [c for c in wanted if c not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    bench = _Bench(device, dtype, model, QUICK_NEW_TOKENS if quick else NEW_TOKENS)
    rows: list[CheckResult] = []

    def add(row: CheckResult) -> None:
        rows.append(row)
        if progress:
            print(f"  {row.status:<4} {row.name} ({row.seconds:.1f}s) {row.detail}", file=sys.stderr, flush=True)

    ref_holder: dict = {}

    def reference():
        runner = bench.reference_runner = bench.runner(attention_backend="torch_native", disable_cuda_graph=True)
        t0 = time.perf_counter()
        ref_holder["ref"] = bench.greedy(runner)
        n = ref_holder["ref"].num_tokens
        return "PASS", f"{n} tokens in {time.perf_counter() - t0:.1f}s (prefill included)"

    add(_timed(f"torch_native eager ({dtype}, reference)", reference))
    ref = ref_holder.get("ref")
    if ref is None:
        return rows

    if "cuda_graph" in wanted:
        add(_timed(*_graph_check(bench, ref)))
    if "triton" in wanted:
        for row in _triton_checks(bench, ref):
            add(row)
    if "flashinfer" in wanted:
        for row in _flashinfer_checks(bench, ref):
            add(row)
    if "overlap" in wanted:
        add(_timed("overlap loop == normal loop (Engine)", lambda: _overlap_check(bench)))
    return rows


def _graph_check(bench: _Bench, ref: Greedy):
    if bench.device == "cpu":

        def run():
            from workbench.core.model_executor.cuda_graph_runner import CudaGraphRunner, StandInGraphMechanism

            runner = bench.reference_runner  # the same weights: no second load on CPU
            runner.graph_runner = CudaGraphRunner(runner, [1, 2, 4], StandInGraphMechanism())
            try:
                runner.graph_runner.capture()
                return _verdict(ref, bench.greedy(runner), _replays(runner.graph_runner))
            finally:
                runner.graph_runner = None

        return "cuda graph runner, stand-in graph (torch_native)", run

    def run_cuda():
        runner = bench.runner(cuda_graph_max_bs=4)
        if runner.graph_runner is None:
            return "FAIL", f"no graphs captured (backend {runner.attn_backend.name})"
        cap = sum(runner.graph_runner.capture_time_s.values())
        return _verdict(ref, bench.greedy(runner), f"{_replays(runner.graph_runner)}; capture {cap:.2f}s")

    from workbench.core.layers.attention.registry import default_attention_backend

    return f"cuda graphs ({default_attention_backend('cuda', bench.dtype)})", run_cuda


INTERPRETED_TRITON_ROW = "triton kernels (TRITON_INTERPRET=1, model head shapes)"


def _triton_checks(bench: _Bench, ref: Greedy) -> list[CheckResult]:
    if importlib.util.find_spec("triton") is None:
        name = "triton backend" if bench.device == "cuda" else INTERPRETED_TRITON_ROW
        return [CheckResult(name, "SKIP", 0.0, "triton is not installed (pip install triton)")]
    if bench.device == "cuda":
        return _backend_checks(bench, ref, "triton")
    from workbench.core.layers.attention.triton_backend import triton_interpreter_unsupported_reason

    reason = triton_interpreter_unsupported_reason()
    if reason:
        return [CheckResult(INTERPRETED_TRITON_ROW, "SKIP", 0.0, reason)]
    return [_timed(INTERPRETED_TRITON_ROW, lambda: _interpreted_kernels(bench))]


def _interpreted_kernels(bench: _Bench) -> tuple[str, str]:
    """The kernel cases under the interpreter, in a subprocess, with the model's head layout."""
    cfg = bench.prepared.config
    hq = cfg.num_attention_heads
    hk = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "workbench.triton_check", "--json", "--heads", f"{hq},{hk},{d}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        return "FAIL", proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    bad = [r for r in results if r["error"] or not r["max_abs_diff"] < 2e-5]
    worst = max((r["max_abs_diff"] for r in results if not r["error"]), default=float("nan"))
    if bad or not results:
        first = bad[0] if bad else {"id": "-", "error": "no cases ran"}
        return "FAIL", f"{len(bad)}/{len(results)} cases off, e.g. {first['id']}: {first.get('error') or first}"
    return "PASS", f"{len(results)} decode/extend cases (Hq={hq}, Hk={hk}, D={d}), max|diff| {worst:.1e}"


def _flashinfer_checks(bench: _Bench, ref: Greedy) -> list[CheckResult]:
    from workbench.core.layers.attention.flashinfer_backend import flashinfer_unavailable_reason

    reason = flashinfer_unavailable_reason(bench.device, bench.dtype)
    if reason:
        return [CheckResult("flashinfer backend", "SKIP", 0.0, reason)]
    return _backend_checks(bench, ref, "flashinfer")


def _backend_checks(bench: _Bench, ref: Greedy, backend: str) -> list[CheckResult]:
    """`backend` on CUDA against the torch-native reference, eager and through CUDA graphs."""

    def eager():
        return _verdict(ref, bench.greedy(bench.runner(attention_backend=backend, disable_cuda_graph=True)))

    def graphed():
        runner = bench.runner(attention_backend=backend, cuda_graph_max_bs=4)
        return _verdict(ref, bench.greedy(runner), _replays(runner.graph_runner))

    return [_timed(f"{backend} backend (eager)", eager), _timed(f"{backend} backend + cuda graphs", graphed)]


def _overlap_check(bench: _Bench) -> tuple[str, str]:
    from workbench.core.engine import Engine

    outs = {}
    for overlap in (False, True):
        with Engine(
            model_path=bench.model,
            device=bench.device,
            dtype=bench.dtype,
            disable_overlap_schedule=not overlap,
            show_progress=False,
            num_threads=1 if bench.device == "cpu" else None,
        ) as engine:
            res = [
                engine.generate(
                    input_ids=p, sampling_params={"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
                )
                for p, n in zip(bench.prompts, bench.new_tokens)
            ]
            outs[overlap] = [r["output_ids"] for r in res]
    if outs[True] != outs[False]:
        return "FAIL", f"overlap {outs[True]} != normal {outs[False]}"
    return "PASS", f"{sum(len(t) for t in outs[True])} tokens equal"


# ---- table and CLI --------------------------------------------------------------------------------
def format_table(rows: list[CheckResult], device: str) -> str:
    width = max(len(r.name) for r in rows) + 2
    lines = [f"{'check':<{width}}{'result':<8}{'time':>8}  detail", "-" * (width + 40)]
    for r in rows:
        t = f"{r.seconds:.1f}s" if r.status != "SKIP" else "-"
        lines.append(f"{r.name:<{width}}{r.status:<8}{t:>8}  {r.detail}")
    failed = sum(r.status == "FAIL" for r in rows)
    lines.append(
        f"{device}: {sum(r.status == 'PASS' for r in rows)} passed, {failed} failed, "
        f"{sum(r.status == 'SKIP' for r in rows)} skipped"
    )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="cuda: the real GPU paths; cpu: the dry run (default: cuda if available)",
    )
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--checks", default=None, help=f"comma-separated subset of {','.join(CHECKS)} (the reference always runs)"
    )
    p.add_argument("--quick", action="store_true", help="fewer new tokens per request (a faster smoke run)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def cli_main(args: argparse.Namespace) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    checks = [c.strip() for c in args.checks.split(",")] if args.checks else None
    rows = run_selftest(device, args.dtype, args.model, checks, progress=not args.quiet, quick=args.quick)
    print(format_table(rows, device))
    return 1 if any(r.status == "FAIL" for r in rows) else 0
