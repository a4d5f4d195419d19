"""What every `workbench bench` command shares: progress lines, A B B A interleaving, load and CPU
sampling, and the figures of ratio tables.

Benchmarks here run on shared machines where a neighbour's burst moves one run by 20% or more, so a
comparison of two sides is measured in rounds of A B B A (each side first and last equally often) with
the 1-minute load average noted beside every measurement, and reported as medians with their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


# ---- progress ---------------------------------------------------------------------------------------
def progress(msg: str) -> None:
    """One progress line on stdout, `[bench] ...`, flushed (a bench's lines interleave with its engines')."""
    print(f"[bench] {msg}", flush=True)


@dataclass
class Stages:
    """Numbered progress, one line per stage with the seconds since the start, to stderr so stdout
    stays the table (or JSON)."""

    total: int
    done: int = 0
    t0: float = field(default_factory=time.perf_counter)
    quiet: bool = False

    def step(self, text: str) -> None:
        """A stage done: `[ k/total]  12.3s  text`."""
        self.done += 1
        self.note(text, f"[{self.done:>2}/{self.total}]")

    def note(self, text: str, tag: str = "       ") -> None:
        """A line that is not a stage of its own."""
        if not self.quiet:
            print(f"{tag} {time.perf_counter() - self.t0:6.1f}s  {text}", file=sys.stderr, flush=True)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, disable: bool):
    """A tqdm bar of `total` requests on stderr; an object that does nothing when disabled or without tqdm."""
    if disable:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)


@contextmanager
def attempt(failures: list[str], what: str) -> Iterator[None]:
    """Measure one configuration; an exception is noted in `failures` and printed, not raised, so the
    configurations after it are still measured (an engine that cannot start leaves the others' rows)."""
    try:
        yield
    except Exception as exc:
        failures.append(f"{what}: {type(exc).__name__}: {exc}")
        progress(f"FAILED {failures[-1]}")


def print_failures(failures: list[str]) -> None:
    """Under the table: the configurations `attempt` could not measure."""
    for text in failures:
        print(f"not measured: {text}")


def engine_parser(bench_sub, name: str, help: str, description: str) -> argparse.ArgumentParser:
    """The parser of `workbench bench NAME` for a bench that starts Engines: every `workbench serve`
    flag (ServerArgs), then the bench's own, which the caller adds."""
    from workbench.core.args import ServerArgs

    p = bench_sub.add_parser(name, help=help, description=description)
    ServerArgs.add_cli_args(p)
    return p


# ---- load and CPU sampling ----------------------------------------------------------------------------
def load_1m() -> float:
    """The 1-minute load average (NaN where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def load_text(digits: int = 1) -> str:
    """The 1-minute load average as text, "?" where the platform has none."""
    return f"{os.getloadavg()[0]:.{digits}f}" if hasattr(os, "getloadavg") else "?"


def busy_warning() -> str | None:
    """A warning when other processes keep the CPU busy: then every engine's multi-threaded
    kernels wait at thread barriers for descheduled threads, and timings stop meaning much."""
    if not hasattr(os, "getloadavg"):
        return None
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load < 0.75 * cores:
        return None
    return (
        f"warning: load average {load:.1f} on {cores} cores: timings will be noisy and multi-threaded "
        f"ones can collapse (OpenMP threads spin at barriers for descheduled peers); for steadier "
        f"ratios use --threads 1 --clock cpu, or start with OMP_WAIT_POLICY=PASSIVE"
    )


def bench_cpus() -> list[int]:
    """The CPU ids this process may run on (all of them where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_seconds(pids) -> float:
    """User + system CPU seconds of these processes and all their descendants (gone ones count 0)."""
    import psutil

    seen, total = set(), 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            family = [proc] + proc.children(recursive=True)
        except psutil.Error:
            continue
        for p in family:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    return total


# ---- A B B A ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    """One measurement of an A B B A run: which side runs, which idles, in which round."""

    round: int  # 0-based
    rounds: int
    side: str
    other: str

    @property
    def tag(self) -> str:
        """`[round/rounds]`, 1-based, as progress lines print it."""
        return f"[{self.round + 1}/{self.rounds}]"


def abba(a: str, b: str, rounds: int) -> Iterator[Turn]:
    """`rounds` rounds of A, B, B, A: each side runs first and last equally often, so a drift in the
    machine's load lands on both."""
    for r in range(rounds):
        for side in (a, b, b, a):
            yield Turn(r, rounds, side, b if side == a else a)


@dataclass
class Interleaved(Generic[T]):
    """What an A B B A run measured: per side its measurements in order, the load after each, and
    (when asked) the cores the idle side's processes used while the other ran."""

    samples: dict[str, list[T]]
    loads: list[float] = field(default_factory=list)
    idle_cores: dict[str, list[float]] = field(default_factory=dict)


def interleave(
    measure: dict[str, Callable[[], T]],
    rounds: int,
    report: Callable[[Turn, T, float, float | None], None] | None = None,
    idle_pids: dict[str, list[int]] | None = None,
) -> Interleaved[T]:
    """Measure two sides in `rounds` rounds of A B B A (A is `measure`'s first key).

    After each measurement the 1-minute load is sampled; with `idle_pids` (side -> process ids) the
    idle side's CPU use during the measurement is taken too, in cores (the fairness check: it should
    be ~0). `report(turn, value, load, idle_cores)` is called after each measurement (progress lines)."""
    a, b = measure
    out: Interleaved[T] = Interleaved({a: [], b: []}, [], {a: [], b: []})
    for turn in abba(a, b, rounds):
        idle = None
        if idle_pids is not None:
            c0, t0 = cpu_seconds(idle_pids[turn.other]), time.perf_counter()
        value = measure[turn.side]()
        if idle_pids is not None:
            idle = (cpu_seconds(idle_pids[turn.other]) - c0) / max(1e-9, time.perf_counter() - t0)
            out.idle_cores[turn.other].append(idle)
        load = load_1m()
        out.samples[turn.side].append(value)
        out.loads.append(load)
        if report is not None:
            report(turn, value, load, idle)
    return out


# ---- ratio tables -------------------------------------------------------------------------------------
def median_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(median of a, median of b, their ratio a / b; NaN when b's median is not positive)."""
    ma, mb = statistics.median(a), statistics.median(b)
    return ma, mb, ma / mb if mb > 0 else float("nan")


def ratio_text(ratio: float) -> str:
    """`1.23×`, or `n/a` for NaN (a side that measured nothing)."""
    return f"{ratio:.2f}×" if ratio == ratio else "n/a"


def goal_text(ratio: float | None, goal: float) -> str:
    """Whether a ratio meets a goal: `met`, `not met`, or `n/a` (None or NaN)."""
    if ratio is None or ratio != ratio:
        return "n/a"
    return "met" if ratio >= goal else "not met"


def load_range(loads: list[float]) -> str:
    """The loads seen during a row's measurements, `min–max` (empty when none were taken)."""
    return f"{min(loads):.2f}–{max(loads):.2f}" if loads else ""


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (paste-able into the docs): a header row, its rule, one line a row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)
