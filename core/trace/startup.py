"""Engine start-up phases: reported where they happen, folded into one picture for the views.

A process that starts part of the engine calls `report_phase("weights")` (or `with
phase("kernels"): ...` for a nested one, which hands back to the phase it interrupted). The
reports go to whatever `set_phase_sink` installed: the scheduler's rank 0 sends them up its
ready pipe, the Engine hands its own and its children's to `on_phase` and prints them. The
views fold `engine.phase` events into a `StartupProgress` and draw from that alone.

Why: the first start on a machine compiles kernels and converts the model, which can take a
minute or more on a small CPU; a screen that only says "Starting…" leaves the user guessing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from workbench.core.trace import events as ev

#: The phases in the order a start goes through them (a phase may be skipped: a simulated
#: deployment loads no weights, a machine that built its kernels before builds none). A nested
#: one interrupts another: on CPU the kernels are built inside the warm-up, when the attention
#: backend first needs them (warmup, kernels, warmup).
PHASES = ("model", "processes", "weights", "kernels", "warmup", "ready")

#: What each phase is, in the words the console and the TUI use.
PHASE_LABELS = {
    "model": "preparing the model (finding, downloading or converting it)",
    "processes": "starting the scheduler and detokenizer processes",
    "weights": "loading weights",
    "kernels": "building kernels (once per machine)",
    "warmup": "warming up (KV cache, attention backend, captured graphs)",
    "ready": "ready",
    "failed": "failed",
}

PhaseSink = Callable[[ev.EnginePhase], None]

_sink: PhaseSink | None = None
_current: ev.EnginePhase | None = None


def set_phase_sink(sink: PhaseSink | None) -> None:
    """Where this process's reports go (None: nowhere; reporting then costs nothing)."""
    global _sink, _current
    _sink = sink
    _current = None


def report_phase(name: str, detail: str = "", *, proc: str = "") -> None:
    """Say that this process has begun phase `name` (one of PHASES)."""
    global _current
    event = ev.EnginePhase(ts=time.monotonic_ns(), proc=proc or _proc_name(), phase=name, detail=detail)
    _current = event
    sink = _sink
    if sink is None:
        return
    try:
        sink(event)
    except (OSError, ValueError):  # the parent went away: start-up ends without us anyway
        pass


@contextlib.contextmanager
def phase(name: str, detail: str = "") -> Iterator[None]:
    """A nested phase (the CPU kernels, built when the warm-up first needs them): reports `name`,
    then, when the block ends, the phase that was running before it."""
    before = _current
    report_phase(name, detail)
    try:
        yield
    finally:
        if before is not None:
            report_phase(before.phase, before.detail, proc=before.proc)


def _proc_name() -> str:
    import multiprocessing

    name = multiprocessing.current_process().name
    return name.removeprefix("workbench-") if name != "MainProcess" else "engine"


# ---- folding (what the views read) -----------------------------------------------------


@dataclass
class PhaseView:
    """One phase as a view shows it: its time so far (every stretch it ran), whether it runs now."""

    name: str
    detail: str = ""
    seconds: float = 0.0
    running: bool = False
    started_ns: int = 0  # when its current stretch began (running only)

    @property
    def label(self) -> str:
        return PHASE_LABELS.get(self.name, self.name)

    def elapsed(self, now_ns: int) -> float:
        """Seconds spent in this phase, the running stretch counted up to `now_ns`."""
        return self.seconds + (max(0, now_ns - self.started_ns) / 1e9 if self.running else 0.0)


@dataclass
class StartupProgress:
    """The start-up so far, folded from `engine.phase` events (any other event is ignored)."""

    phases: list[PhaseView] = field(default_factory=list)
    log_path: str = ""
    first_ns: int | None = None

    def apply(self, event: ev.Event) -> None:
        if not isinstance(event, ev.EnginePhase):
            return
        if event.log_path:
            self.log_path = event.log_path
        if self.first_ns is None:
            self.first_ns = event.ts
        for p in self.phases:  # the one running ends now
            if p.running:
                p.seconds += max(0, event.ts - p.started_ns) / 1e9
                p.running = False
        view = next((p for p in self.phases if p.name == event.phase), None)
        if view is None:
            view = PhaseView(event.phase)
            self.phases.append(view)
        view.detail = event.detail or view.detail
        view.running = event.phase not in ("ready", "failed")
        view.started_ns = event.ts

    @property
    def current(self) -> PhaseView | None:
        """The phase running now (None before the first report and once ready or failed)."""
        return next((p for p in self.phases if p.running), None)

    @property
    def done(self) -> bool:
        return any(p.name in ("ready", "failed") for p in self.phases)

    def order(self) -> list[str]:
        """The phases' names in the order they first began."""
        return [p.name for p in self.phases]
