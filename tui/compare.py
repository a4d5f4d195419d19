"""`workbench tui --compare FLAG=A,B`: two engines one setting apart, side by side, on one clock.

    workbench tui --compare schedule_policy=fcfs,lpm                      # two simulated engines (default)
    workbench tui --compare chunked_prefill_size=256,2048 --simulate h100 --model llama-3.1-8b
    workbench tui --compare schedule_policy=fcfs,lpm --real               # two real engines, one workload each

Simulated (the default), both sides are `SimPair`'s (core/simulation/compare.py): the real scheduler
on a simulated clock, the same seeded arrivals, both advanced to the same simulated instant, so step
N of one is comparable with step N of the other. The screen: one column per side with the usual
Queues, Batch composition and Radix tree panels (the same panel classes as `workbench tui`, each fed
its side's TuiModel), the per-step diff (`step 39: fcfs admitted r4 (0 cached) · lpm admitted r7 (160
cached)`) and both sides' TTFT CDFs overlaid. Views read only trace events and the reducer.
"""

from __future__ import annotations

import math
from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Static
from workbench.core.trace.compare import StepDiff, percentile, ttft_cdf
from workbench.core.trace.palette import CACHED, DECODE
from workbench.tui.fmt import fmt_s
from workbench.tui.model import TuiModel
from workbench.tui.panels.batch import BatchPanel
from workbench.tui.panels.queues import QueuesPanel
from workbench.tui.panels.tree import TreePanel

#: Each side's colour in the CDF and its column's label.
SIDE_COLOURS = (CACHED, DECODE)
SIDE_MARKS = ("●", "○")


class SimCompareSource:
    """A `SimPair` stepped at `rate` steps per wall second (each step: the side that is behind
    takes its next action, the clock moves on for both; rate 0: as fast as this host can)."""

    kind = "SIMULATED"

    def __init__(self, pair: Any, rate: float = 10.0, paused: bool = False):
        self.pair = pair
        self.labels = list(pair.labels)
        self.title = f"{pair.title} · {pair.field}: {' vs '.join(self.labels)}"
        self.rate = rate
        self.paused = paused
        self._owed = 0.0

    def tick(self, dt: float) -> None:
        """`dt` wall seconds passed: take the steps they are worth (a bounded number per tick)."""
        if self.paused or self.pair.done:
            return
        if self.rate <= 0:
            self.pair.run(max_actions=200)
            return
        self._owed = min(self._owed + dt * self.rate, 200.0)
        n = int(self._owed)
        self._owed -= n
        self.pair.run(max_actions=n)

    def step(self) -> None:
        self.pair.step()

    def drain(self, i: int) -> list:
        return self.pair.drain(i)

    def now_ns(self) -> int:
        return int(self.pair.now * 1e9)

    @property
    def done(self) -> bool:
        return self.pair.done

    def status(self) -> str:
        speed = "as fast as possible" if self.rate <= 0 else f"{self.rate:g} steps/s"
        state = "done" if self.done else ("paused" if self.paused else speed)
        return f"simulated t {self.pair.now:.3f} s · {state}"

    def close(self) -> None:
        pass


class RealCompareSource:
    """Two real engines (EngineControllers) one setting apart, each running the same seeded workload
    at the same rate on the host clock (`--real`). Their arrivals follow the same prompts in the same
    order but not to the microsecond, and each step's length is the host's: compare the CDFs more than
    step N with step N."""

    kind = "LIVE"

    def __init__(self, controllers: list[Any], labels: list[str], workload: str = "shared-prefix", rate: float = 2.0):
        """`controllers`: EngineControllers without a workload of their own; `workload` starts on both
        at `rate` once both are up (so neither gets a head start)."""
        self.controllers = controllers
        self.workload, self.workload_rate = workload, rate
        self.labels = labels
        self.title = " vs ".join(labels)
        self.rate = 0.0
        self.paused = False
        self.done = False

    def start(self, progress) -> None:
        """Start both engines, one after the other (started at once in two threads, their imports
        raced: transformers' lazy modules are not thread-safe), then the workload on both."""
        for label, c in zip(self.labels, self.controllers):

            def report(msg: Any, label: str = label) -> None:  # a line, or a live engine's `engine.phase`
                text = msg if isinstance(msg, str) else " ".join(str(getattr(msg, k, "")) for k in ("phase", "detail"))
                progress(f"{label}: {text.strip()}")

            c.start(report)
        import itertools

        for c in self.controllers:  # back to back: the same seeded prompts, from the same instant,
            # numbered alike on both sides (sp-1, sp-2, ...: the process-wide counter interleaved them)
            c.start_workload(self.workload, rate=self.workload_rate, ids=itertools.count(1))

    def tick(self, dt: float) -> None:
        pass

    def step(self) -> None:
        for c in self.controllers:
            c.step()

    def set_paused(self, paused: bool) -> None:
        for c in self.controllers:
            c.set_paused(paused)
        self.paused = paused

    def drain(self, i: int) -> list:
        return self.controllers[i].drain()

    def now_ns(self) -> int:
        return self.controllers[0].now_ns()

    def status(self) -> str:
        return "paused" if self.paused else "live"

    def close(self) -> None:
        for c in self.controllers:
            c.close()


def cdf_text(series: list[tuple[str, list[float]]], width: int = 60, height: int = 8) -> Text:
    """TTFT CDFs overlaid as characters: x is TTFT (0 to the largest), y the fraction of requests;
    each side's points in its colour and mark, `◉` where both fall; p50/p99 of each below."""
    xs_all = [x for _, xs in series for x in xs]
    out = Text()
    if not xs_all:
        return out.append("no first tokens yet", style="dim")
    hi = max(xs_all) or 1e-9
    grid: list[list[int]] = [[0] * width for _ in range(height)]  # bit i: side i has a point there
    for i, (_, xs) in enumerate(series):
        n = len(xs)
        for col in range(width):
            t = hi * (col + 1) / width
            frac = sum(1 for x in xs if x <= t) / n if n else 0.0  # fine: a few hundred points
            if frac <= 0:
                continue
            row = height - 1 - min(height - 1, int(math.ceil(frac * height)) - 1)
            grid[row][col] |= 1 << i
    for r, cells in enumerate(grid):
        label = f"{1 - r / height:>4.0%} " if r % 2 == 0 else "     "
        out.append(label, style="dim")
        for bits in cells:
            if bits == 3:
                out.append("◉", style="bold")
            elif bits:
                i = 0 if bits == 1 else 1
                out.append(SIDE_MARKS[i], style=SIDE_COLOURS[i])
            else:
                out.append("·", style="dim")
        out.append("\n")
    out.append(f"     0{'TTFT':^{max(4, width - 12)}}{fmt_s(hi)}\n", style="dim")
    for i, (label, xs) in enumerate(series):
        p50, p99 = percentile(xs, 0.5), percentile(xs, 0.99)
        out.append(f"{SIDE_MARKS[i]} {label}", style=f"bold {SIDE_COLOURS[i]}")
        if xs:
            out.append(f"  p50 {fmt_s(p50)} · p99 {fmt_s(p99)} · {len(xs)} first tokens")
        else:
            out.append("  no first tokens yet")
        if i < len(series) - 1:
            out.append("\n")
    return out


class SideColumn(Vertical):
    """One side: its label, Queues, Batch composition and Radix tree over its own TuiModel."""

    DEFAULT_CSS = """
    SideColumn { width: 1fr; }
    SideColumn > .side-label { height: 1; text-style: bold; padding: 0 1; }
    """

    def __init__(self, index: int, label: str, model: TuiModel, **kw) -> None:
        super().__init__(**kw)
        self.index, self.label, self.model = index, label, model

    def compose(self) -> ComposeResult:
        mark = SIDE_MARKS[self.index]
        yield Static(Text(f"{mark} {self.label}", style=SIDE_COLOURS[self.index]), classes="side-label")
        yield QueuesPanel(id=f"queues-{self.index}")
        yield BatchPanel(id=f"batch-{self.index}")
        yield TreePanel(id=f"tree-{self.index}")

    def refresh_panels(self, force: bool = False) -> None:
        for panel in self.query("QueuesPanel, BatchPanel, TreePanel"):
            panel.refresh_view(self.model, force)  # type: ignore[attr-defined]


class CompareApp(App):
    """Two engines side by side: a column per side, the per-step diff and the TTFT CDFs. The caller
    closes the source once the app returns (two real engines take a while to shut down: not on the
    UI thread)."""

    TITLE = "workbench compare"
    CSS = """
    #sides { height: 3fr; }
    #bottom { height: 15; }
    #diff { width: 1fr; border: round $panel-lighten-2; padding: 0 1; }
    #ttft-cdf { width: 1fr; border: round $panel-lighten-2; padding: 0 1; }
    #status { height: 1; padding: 0 1; background: $boost; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("p", "toggle_pause", "pause/run"),
        Binding("s", "step", "step"),
        Binding("plus,equals_sign", "faster", "faster"),
        Binding("minus", "slower", "slower"),
    ]

    def __init__(self, source: Any, refresh_hz: float = 10.0, **kw) -> None:
        super().__init__(**kw)
        self.source = source
        self.models = [TuiModel(), TuiModel()]
        self.diff = StepDiff(source.labels)
        self.refresh_hz = refresh_hz
        self.startup_error = ""
        self._starting: dict[str, str] = {}  # side -> its latest start-up line (--real)

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        with Horizontal(id="sides"):
            for i, label in enumerate(self.source.labels):
                yield SideColumn(i, label, self.models[i], id=f"side-{i}")
        with Horizontal(id="bottom"):
            yield Static(id="diff")
            yield Static(id="ttft-cdf")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#diff").border_title = "Where they differ"
        self.query_one("#ttft-cdf").border_title = "TTFT CDF"
        start = getattr(self.source, "start", None)
        if start is not None:
            self.run_worker(self._start, thread=True, exclusive=True)
        else:
            self._started()

    def _start(self) -> None:
        try:
            self.source.start(self._progress)
        except Exception as exc:  # a real engine that does not come up: say why and leave
            from workbench.tui.controller import friendly

            self.startup_error = friendly(exc)
            self.call_from_thread(self.exit, 1)
            return
        self.call_from_thread(self._started)

    def _progress(self, line: str) -> None:
        """A start-up line (from the starting thread): shown in the status line until both are up."""
        label, _, text = line.partition(": ")
        self._starting[label] = text
        status = "starting " + " · ".join(f"{k}: {v}" for k, v in self._starting.items())
        self.call_from_thread(self.query_one("#status", Static).update, Text(status[:400], style="italic"))

    def _started(self) -> None:
        self._last = self._clock()
        self.set_interval(1.0 / self.refresh_hz, self._tick)
        self._tick()

    def _clock(self) -> float:
        import time

        return time.monotonic()

    def _tick(self) -> None:
        now = self._clock()
        self.source.tick(now - self._last)
        self._last = now
        self._fold()

    def _fold(self, force: bool = False) -> None:
        """Fold both sides' new events, redraw the columns, the diff and the CDFs."""
        now_ns = self.source.now_ns()
        for i, model in enumerate(self.models):
            model.apply(self.source.drain(i))
            model.now_ns = now_ns
        self.diff.update(self.models[0].state, self.models[1].state)
        for col in self.query(SideColumn):
            # forced: a panel's own throttle counts trace time, here simulated seconds, which
            # may crawl (a 2 ms step each tick) and would hold the panels back dozens of steps
            col.refresh_panels(force=True)
        self._draw_bottom()

    def _draw_bottom(self) -> None:
        d = self.diff
        steps = [m.state.steps[-1].step if m.state.steps else 0 for m in self.models]
        title = self.source.title
        kind = "" if title.startswith(self.source.kind) else f"{self.source.kind} "
        status = Text(f"{kind}{title} · {self.source.status()} · steps ")
        status.append(" / ".join(str(s) for s in steps))
        self.query_one("#status", Static).update(status)
        diff = self.query_one("#diff", Static)
        diff.border_title = f"Where they differ — {d.differed} of {d.compared} steps admitted differently"
        lines = [line for _, line in d.lines[-12:]]
        diff.update(Text("\n".join(lines)) if lines else Text("no step admitted differently yet", style="dim"))
        cdf = self.query_one("#ttft-cdf", Static)
        width = max(20, (cdf.size.width or 60) - 8)
        series = [(label, ttft_cdf(m.state)[0]) for label, m in zip(self.source.labels, self.models)]
        cdf.update(cdf_text(series, width=width, height=8))

    def action_toggle_pause(self) -> None:
        setter = getattr(self.source, "set_paused", None)
        if setter is not None:
            self.run_worker(lambda: setter(not self.source.paused), thread=True)
        else:
            self.source.paused = not self.source.paused
        self._fold()

    def action_step(self) -> None:
        """One step: pauses first; a real pair's step is an engine call, so off the UI thread."""
        if getattr(self.source, "set_paused", None) is not None:
            source = self.source

            def step() -> None:
                if not source.paused:
                    source.set_paused(True)
                source.step()

            self.run_worker(step, thread=True)
            return
        self.source.paused = True
        self.source.step()
        self._fold()

    def action_faster(self) -> None:
        if self.source.rate > 0:
            self.source.rate = min(1000.0, self.source.rate * 2)

    def action_slower(self) -> None:
        self.source.rate = max(0.5, (self.source.rate or 1000.0) / 2)


def make_compare_source(args: Any) -> SimCompareSource | RealCompareSource:
    """The source for `workbench tui --compare FLAG=A,B [--real]` (raises ValueError with what to write)."""
    from workbench.core.args import ServerArgs
    from workbench.core.simulation.compare import SimPair, compare_workload, parse_compare

    field, values = parse_compare(args.compare)
    sa = ServerArgs.from_cli_args(args)
    if getattr(args, "real", False):
        return _real_source(args, sa, field, values)
    given = _changed_settings(sa)
    for k in ("model_path", "simulate", "tp_size", field):
        given.pop(k, None)
    seed = sa.random_seed or 0
    n = getattr(args, "compare_requests", None) or 120
    rate = getattr(args, "rate", None) or 100.0
    pair = SimPair(
        field,
        values,
        model=sa.model_path or "smollm2-135m",
        hardware=sa.simulate or "l4",
        tp_size=sa.tp_size,
        workload=compare_workload(n=n, rate=rate, seed=seed),
        seed=seed,
        **given,
    )
    return SimCompareSource(pair, rate=getattr(args, "compare_speed", 10.0), paused=getattr(args, "paused", False))


# Settings a simulated side does not take from the command line (the host's, or the TUI's own).
_NOT_SIMULATED = {"device", "sim_speed", "host", "port", "log_level", "trace_publish", "random_seed", "dtype"}


def _changed_settings(sa: Any) -> dict[str, Any]:
    """The ServerArgs fields the command line set away from their defaults."""
    import dataclasses

    from workbench.core.args import ServerArgs

    base = ServerArgs()
    return {
        f.name: getattr(sa, f.name)
        for f in dataclasses.fields(sa)
        if f.name not in _NOT_SIMULATED and getattr(sa, f.name) != getattr(base, f.name)
    }


def _real_source(args: Any, sa: Any, field: str, values: list[Any]) -> RealCompareSource:
    import dataclasses

    from workbench.core.simulation.compare import side_label
    from workbench.tui.controller import EngineController

    kind = getattr(args, "workload", None) or "shared-prefix"
    rate = getattr(args, "rate", None) or 2.0
    controllers = [
        EngineController(
            server_args=dataclasses.replace(sa, **{field: v}),
            rate=rate,
            max_new_tokens=getattr(args, "workload_max_new_tokens", 32),
        )
        for v in values
    ]
    return RealCompareSource(controllers, [side_label(field, v, values) for v in values], workload=kind, rate=rate)
