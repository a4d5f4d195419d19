"""Dashboard.compare: two simulated engines one setting apart, side by side in a notebook.

    cmp = Dashboard.compare("schedule_policy=fcfs,lpm")     # the default workload: shared prefixes, a queue
    cmp.advance(40)                                         # 40 steps on the shared clock, then redraw
    cmp.diff_lines[:3]                                      # ['step 39: fcfs admitted r4 (0 cached) · lpm ...']
    cmp.run()                                               # to the end
    cmp.cdf()                                               # {'fcfs': (ttfts, fractions), 'lpm': (...)}

The pair is `SimPair` (core/simulation/compare.py): the real scheduler on a simulated clock, one seeded
arrival stream, both sides advanced to the same simulated instant. Each side folds its events into
its own TraceState and is drawn with the static pictures (`widgets/static.py`: queues, batch, radix);
below them, where their steps admitted differently (`core/trace/compare.py`) and both TTFT CDFs on
one plot. Buttons step the pair; everything also works from code, so a notebook run top to bottom
shows the same pictures.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as W
from workbench.core.simulation.compare import SimPair, compare_workload, parse_compare
from workbench.core.trace.compare import StepDiff, percentile, ttft_cdf
from workbench.core.trace.palette import PALETTE as P
from workbench.core.trace.state import TraceState
from workbench.widgets.static import _Svg, batch_svg, queues_svg, tree_svg

#: Each side's colour (the TUI's: the cached colour, then the decode one).
SIDE_COLOURS = (P["cached"], P["decode"])


def cdf_svg(series: list[tuple[str, list[float]]], *, width: int = 900, height: int = 260) -> str:
    """The TTFT CDFs of the sides on one plot (a step line each, in its side's colour)."""
    svg = _Svg("ttft-cdf", width, height, "TTFT CDF (simulated time)")
    svg.legend([(label, SIDE_COLOURS[i]) for i, (label, _) in enumerate(series)])
    xs_all = [x for _, xs in series for x in xs]
    if not xs_all:
        svg.empty("no first tokens yet")
        return svg.render()
    to_ms = 1000.0
    x = svg.x_axis(0.0, max(xs_all) * to_ms, "TTFT (ms)")
    y = svg.y_axis(1.0, "fraction of requests", exact=True)
    for i, (label, xs) in enumerate(series):
        if not xs:
            continue
        n = len(xs)
        pts = [f"{x(0):.1f},{y(0):.1f}"]
        for k, v in enumerate(xs):
            pts.append(f"{x(v * to_ms):.1f},{y(k / n):.1f}")
            pts.append(f"{x(v * to_ms):.1f},{y((k + 1) / n):.1f}")
        p50 = percentile(xs, 0.5) or 0.0
        svg.add(
            f'<polyline class="cdf-{html.escape(label)}" points="{" ".join(pts)}" fill="none" '
            f'stroke="{SIDE_COLOURS[i]}" stroke-width="2"><title>{html.escape(label)}: p50 '
            f"{p50 * to_ms:.1f} ms, {n} requests</title></polyline>"
        )
    return svg.render(sides=",".join(label for label, _ in series))


class CompareDashboard(W.VBox):
    """Two simulated engines side by side (see the module doc).

    Args:
        spec: "FLAG=A,B", the engine setting compared and its two values (any ServerArgs field).
        pair: a SimPair already built (instead of spec and the rest).
        requests, rate, seed: the default arrival stream (`compare_workload`) when `workload` is not given.
        width: the whole widget's width in pixels.
        kw: SimPair's (model, hardware, tp_size, workload, and engine settings shared by both sides).
    """

    def __init__(
        self,
        spec: str = "schedule_policy=fcfs,lpm",
        *,
        pair: SimPair | None = None,
        requests: int = 60,
        rate: float = 100.0,
        seed: int = 0,
        width: int = 1100,
        **kw: Any,
    ):
        super().__init__()
        if pair is None:
            field, values = parse_compare(spec)
            kw.setdefault("workload", compare_workload(n=requests, rate=rate, seed=seed))
            pair = SimPair(field, values, seed=seed, **kw)
        self.pair = pair
        self.labels = list(pair.labels)
        self.states = [TraceState(), TraceState()]
        self.diff = StepDiff(self.labels)
        self.width = width
        self.header = W.HTML()
        self.sides = [W.HTML(layout=W.Layout(width=f"{width // 2 - 4}px")) for _ in range(2)]
        self.diff_box = W.HTML()
        self.cdf_box = W.HTML()
        buttons = []
        for label, steps in (("Step", 1), ("+10 steps", 10), ("+100 steps", 100), ("Run to end", None)):
            b = W.Button(description=label, layout=W.Layout(width="110px"))
            b.on_click(lambda _b, n=steps: self.run() if n is None else self.advance(n))
            buttons.append(b)
        self.controls = W.HBox(buttons)
        self.children = [self.header, self.controls, W.HBox(self.sides), self.diff_box, self.cdf_box]
        self.add_class("workbench-compare")
        self.refresh()

    # ---- driving -----------------------------------------------------------------------------

    def advance(self, steps: int = 1) -> CompareDashboard:
        """Take `steps` steps on the shared clock (each: the side that is behind takes its next
        action, the other whatever is due by then), then redraw."""
        self.pair.run(max_actions=steps)
        self.refresh()
        return self

    def run(self) -> CompareDashboard:
        """Run both sides to the end of the workload, then redraw."""
        self.pair.run()
        self.refresh()
        return self

    # ---- what it shows -----------------------------------------------------------------------

    @property
    def diff_lines(self) -> list[str]:
        """Every step so far where the two sides admitted differently, as one line each."""
        return [line for _, line in self.diff.lines]

    def cdf(self) -> dict[str, tuple[list[float], list[float]]]:
        """Each side's TTFT CDF so far: label -> (TTFTs in seconds, sorted; fraction at or below each)."""
        return {label: ttft_cdf(st) for label, st in zip(self.labels, self.states)}

    def refresh(self) -> None:
        """Fold new events and redraw everything."""
        for i, st in enumerate(self.states):
            st.apply_many(self.pair.drain(i))
        self.diff.update(*self.states)
        half = self.width // 2 - 8
        steps = [st.steps[-1].step if st.steps else 0 for st in self.states]
        state = "done" if self.pair.done else "running"
        self.header.value = (
            f"<div class='workbench-header'><b>{html.escape(self.pair.title)}</b> · {html.escape(self.pair.field)}: "
            f"{' vs '.join(html.escape(x) for x in self.labels)} · simulated t {self.pair.now:.3f} s · steps "
            f"{steps[0]} / {steps[1]} · {state}</div>"
        )
        for i, (box, st) in enumerate(zip(self.sides, self.states)):
            colour = SIDE_COLOURS[i]
            box.value = (
                f"<div class='workbench-compare-side' data-side='{html.escape(self.labels[i])}'>"
                f"<div style='font-weight:bold;color:{colour}'>{html.escape(self.labels[i])}</div>"
                + queues_svg(st, width=half, height=180)
                + batch_svg(st, width=half, height=220, max_steps=40)
                + tree_svg(st, width=half)
                + "</div>"
            )
        d = self.diff
        lines = "".join(f"<div>{html.escape(line)}</div>" for line in self.diff_lines[-12:])
        self.diff_box.value = (
            f"<div class='workbench-compare-diff'><b>Where they differ</b> — {d.differed} of {d.compared} steps "
            f"admitted differently{' (the latest 12)' if d.differed > 12 else ''}"
            f"<div style='font-family:monospace;font-size:12px'>{lines or '<i>none yet</i>'}</div></div>"
        )
        series = [(label, ttft_cdf(st)[0]) for label, st in zip(self.labels, self.states)]
        self.cdf_box.value = cdf_svg(series, width=self.width - 20)

    def _repr_html_(self) -> str:  # nbconvert without a widget manager: the same pictures as HTML
        return (
            self.header.value
            + "<div style='display:flex'>"
            + "".join(s.value for s in self.sides)
            + "</div>"
            + (self.diff_box.value + self.cdf_box.value)
        )
