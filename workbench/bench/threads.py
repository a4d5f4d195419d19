"""`workbench bench threads`: does the engine keep its speed when it shares the machine?

The main job runs the engine beside a TUI on one machine, so the number that matters is
not the quiet one alone but what is left of it with a neighbour. For each thread policy
(the adaptive default, `--num-threads 1`, `--num-threads <all cores>`) one persistent
Engine runs two workloads:

- bs1: one 64-token prompt, 128 new tokens: decode tokens/s (first token -> last);
- bs32: 32 prompts of 32-256 tokens, 64 new each: output tokens/s over the batch;

under three neighbours, interleaved quiet, busy, tui, quiet so drift shows:

- quiet: nothing else started;
- busy: one plain busy-loop process per core but one (`while True: pass`);
- tui: the real Textual TUI (headless, 160x48) attached to this engine's trace publisher,
  rendering every step, as in `workbench tui`.

Each figure is printed with the 1-minute load average beside it, and each neighbour's
figure as a ratio of the same policy's quiet median (goal: >= 0.6). A cell that runs past
`--cell-timeout` is cut short (its requests aborted) and reported as at most what it reached.
This lives in the host package, not in core: it starts a view as the neighbour.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from workbench.bench.gemm_work import LinearShapes, WorkloadWork
from workbench.bench.harness import bench_cpus, load_1m
from workbench.bench.prompts import random_ids

NEIGHBOURS = ("quiet", "busy", "tui")
GOAL = 0.6


@dataclass
class Cell:
    policy: str
    neighbour: str
    workload: str
    tok_s: float
    load: float
    cut_short: bool = False


@dataclass
class PolicyResult:
    policy: str
    threads_line: str
    cells: list[Cell] = field(default_factory=list)
    thread_counts: dict = field(default_factory=dict)  # neighbour -> compute threads seen at the end
    # workload -> the linears' FLOPs per output token (gemm_work.py), and the machine's compute peak for
    # the engine's dtype on all the bench's cores (`workbench bench peak`): the quiet GEMM column
    flops_per_token: dict = field(default_factory=dict)
    peak_gflops: float | None = None


def _busy_loop(stop) -> None:
    while not stop.is_set():
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TUI_NEIGHBOUR = """
import sys
from workbench.tui.app import WorkbenchApp
from workbench.tui.controller import AttachController
app = WorkbenchApp(AttachController(sys.argv[1]), layout="grid")
app.run(headless=True, size=(160, 48))
"""


class Neighbour:
    """Starts and stops one kind of neighbour process(es)."""

    def __init__(self, kind: str, attach: str | None):
        self.kind, self.attach = kind, attach
        self.procs: list = []
        self.stop_event = None

    def __enter__(self) -> Neighbour:
        if self.kind == "busy":
            ctx = mp.get_context("spawn")
            self.stop_event = ctx.Event()
            n = max(1, len(bench_cpus()) - 1)
            self.procs = [ctx.Process(target=_busy_loop, args=(self.stop_event,), daemon=True) for _ in range(n)]
            for p in self.procs:
                p.start()
        elif self.kind == "tui":
            self.log = tempfile.TemporaryFile()
            self.procs = [
                subprocess.Popen(
                    [sys.executable, "-c", _TUI_NEIGHBOUR, self.attach], stdout=subprocess.DEVNULL, stderr=self.log
                )
            ]
        time.sleep(1.5 if self.kind == "tui" else 0.5)  # the TUI imports Textual first
        return self

    def __exit__(self, *exc) -> None:
        if self.stop_event is not None:
            self.stop_event.set()
        for p in self.procs:
            if isinstance(p, subprocess.Popen):
                if p.poll() is not None:  # it should have been rendering the whole time
                    self.log.seek(0)
                    raise RuntimeError(
                        f"the TUI neighbour exited early (code {p.returncode}): "
                        f"{self.log.read().decode(errors='replace')[-2000:]}"
                    )
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            else:
                p.join(10)
                if p.is_alive():
                    p.kill()


def _prompts(batch: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    one = random_ids(rng, 1, 64, 100, 40000)
    many = [random_ids(rng, 1, rng.randrange(32, 257), 100, 40000)[0] for _ in range(batch)]
    return one, many


def _run(engine, prompts, new_tokens: int, timeout_s: float, decode_only: bool) -> tuple[float, bool]:
    """tokens/s of one workload; aborts everything after `timeout_s` (then the figure is a bound)."""
    sp = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    cut = threading.Event()

    def abort():
        cut.set()
        engine.abort_request("")

    timer = threading.Timer(timeout_s, abort)
    timer.start()
    t0 = time.perf_counter()
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
    finally:
        timer.cancel()
    wall = time.perf_counter() - t0
    n = sum(len(o["output_ids"]) for o in outs)
    if decode_only:
        ttft = outs[0]["meta_info"].get("ttft") or 0.0
        return (max(0, n - 1)) / max(1e-9, wall - ttft), cut.is_set()
    return n / wall, cut.is_set()


def run_threads_bench(args: argparse.Namespace) -> list[PolicyResult]:
    from workbench.core.engine import Engine

    cores = len(bench_cpus())
    policies = [
        ("adaptive (default)", {}),
        ("--num-threads 1", {"num_threads": 1}),
        (f"--num-threads {cores}", {"num_threads": cores}),
    ]
    wanted = set(args.policies.split(",")) if args.policies else None
    batch, new_one, new_many = (8, 16, 8) if args.quick else (32, 128, 64)
    one, many = _prompts(batch)
    from workbench.bench.peak import get_peak, peak_gflops

    peak = get_peak(cores)  # this machine's compute peak (cached per machine), measured before any engine
    results = []
    for name, kw in policies:
        key = "adaptive" if not kw else str(kw["num_threads"])
        if wanted and key not in wanted:
            continue
        port = _free_port()
        addr = f"tcp://127.0.0.1:{port}"
        print(f"[bench threads] {name}: starting the engine", file=sys.stderr, flush=True)
        extra = {"dtype": args.dtype} if args.dtype else {}
        with Engine(show_progress=False, trace_publish=addr, **kw, **extra) as engine:
            res = PolicyResult(name, engine.scheduler_info.get("threads", ""))
            shapes = LinearShapes.from_config(engine.prepared.config)
            res.peak_gflops = peak_gflops(peak, str(engine.scheduler_info.get("dtype", "float32")), cores)
            res.flops_per_token = {
                "bs1": shapes.body_flops_per_token() + shapes.head_flops_per_token(),  # decode tok/s
                f"bs{batch}": WorkloadWork.of(many, new_many).flops(shapes) / (len(many) * new_many),
            }
            # Warm-up with both shapes: kernels built, oneDNN primitives made, pages touched.
            _run(engine, one, 8, 120, True)
            _run(engine, many, 2, 120, False)
            engine.flush_cache()
            order = ["quiet", "busy", "tui", "quiet"] * args.rounds
            for neighbour in order:
                if neighbour not in args.neighbours:
                    continue
                with Neighbour(neighbour, addr):
                    for workload, prompts, new, decode_only in (
                        ("bs1", one, new_one, True),
                        (f"bs{batch}", many, new_many, False),
                    ):
                        engine.flush_cache()  # every cell computes its prompts
                        tok_s, cut = _run(engine, prompts, new, args.cell_timeout, decode_only)
                        load = load_1m()
                        res.cells.append(Cell(name, neighbour, workload, tok_s, load, cut))
                        print(
                            f"[bench threads] {name:<20} {neighbour:<6} {workload:<5} {tok_s:8.1f} tok/s"
                            f"{' (cut short)' if cut else ''}  load {load:.2f}",
                            file=sys.stderr,
                            flush=True,
                        )
                    res.thread_counts[neighbour] = engine.get_internal_state().get("num_threads")
            results.append(res)
    return results


def format_table(results: list[PolicyResult], neighbours: tuple[str, ...]) -> str:
    lines = [
        "| policy | workload | "
        + " | ".join(f"{n} tok/s" for n in neighbours)
        + " | "
        + " | ".join(f"{n} / quiet" for n in neighbours if n != "quiet")
        + " | quiet GEMM GFLOP/s (% of peak) | threads at end |",
        "|---|---|" + "---|" * (2 * len(neighbours) + 1),
    ]
    from workbench.bench.peak import gemm_text

    for res in results:
        for workload in dict.fromkeys(c.workload for c in res.cells):
            figs, ratios = [], []
            quiet = None
            for n in neighbours:
                cells = [c for c in res.cells if c.neighbour == n and c.workload == workload]
                if not cells:
                    figs.append("-")
                    continue
                med = statistics.median(c.tok_s for c in cells)
                bound = "≤ " if any(c.cut_short for c in cells) else ""
                loads = ", ".join(f"{c.load:.1f}" for c in cells)
                figs.append(f"{bound}{med:.1f} (load {loads})")
                if n == "quiet":
                    quiet = med
                elif quiet:
                    mark = "" if med / quiet >= GOAL else " ✗"
                    ratios.append(f"{bound}{med / quiet:.2f}{mark}")
            threads = ", ".join(f"{n} {t}" for n, t in res.thread_counts.items())
            per_token = res.flops_per_token.get(workload)
            gemm = gemm_text(quiet * per_token / 1e9 if quiet and per_token else None, res.peak_gflops)
            lines.append(
                f"| {res.policy} | {workload} | "
                + " | ".join(figs)
                + " | "
                + " | ".join(ratios)
                + f" | {gemm} | {threads} |"
            )
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "threads", help="throughput with a busy neighbour and a live TUI beside the engine, per thread policy"
    )
    p.add_argument(
        "--policies",
        default=None,
        help="comma-separated subset of: adaptive, 1, and the number of cores (e.g. 2); default all three",
    )
    p.add_argument(
        "--neighbours",
        default=",".join(NEIGHBOURS),
        help=f"comma-separated subset of {', '.join(NEIGHBOURS)} (quiet is the reference)",
    )
    p.add_argument("--rounds", type=int, default=1, help="how many quiet/busy/tui/quiet cycles per policy")
    p.add_argument("--dtype", default=None, help="model dtype (default: the engine's default for this CPU)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small workloads (bs1 16 new tokens; 8 prompts x 8 new): a smoke run, not a measurement",
    )
    p.add_argument(
        "--cell-timeout",
        type=float,
        default=60.0,
        help="seconds before a workload is cut short and reported as a bound",
    )
    p.set_defaults(func=cmd)
    return p


def cmd(args: argparse.Namespace) -> int:
    args.neighbours = tuple(n for n in NEIGHBOURS if n in args.neighbours.split(","))
    if "quiet" not in args.neighbours:
        print("workbench bench threads: --neighbours must include quiet (the reference)", file=sys.stderr)
        return 2
    print(f"cores: {len(bench_cpus())}; load average at start {load_1m():.2f}")
    results = run_threads_bench(args)
    for res in results:
        print(f"{res.policy}: {res.threads_line}")
    print(format_table(results, args.neighbours))
    return 0
