"""Dashboard: every view over one shared TraceFeed, with a header and the right controls.

    dash = Dashboard(engine)                 # live: follows the engine's trace bus
    dash = Dashboard.from_trace("run.jsonl") # replay: Play/slider over the recorded steps

Live, the header offers the engine's step gate (pause / step / resume), which
is how the walkthroughs single-step the scheduler; over a recording it offers
Play and a slider whose position is "after scheduler step k".
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import ipywidgets as W
from workbench.core.trace.state import TraceState
from workbench.widgets import data as D
from workbench.widgets.feed import TraceFeed
from workbench.widgets.views import VIEWS

DEFAULT_VIEWS = ("gantt", "batch", "radix", "kv", "queues", "latency")


class Dashboard(W.VBox):
    """All views of a trace source in one widget.

    Args:
        engine_or_source: an Engine, a subscription, a recording's path, a Replay,
            a list of events or a TraceState (see TraceFeed).
        views: view names, built-in (`VIEWS`) or contributed by a plugin
            (`workbench.plugins`, `registry.add_view`); default: all built-ins.
        max_hz: the most live re-renders per second.
        columns: views per row.
        height: each view's figure height in pixels.
        width: the whole grid's width in pixels. Figures get a fixed width: plotly sizes an
            autosized figure from its container at first render, which a grid cell may not
            have yet (the figure then overflows the cell).
        feed_kw: passed to TraceFeed (e.g. `keep_events=10_000` to keep the raw events).
    """

    def __init__(
        self,
        engine_or_source: Any,
        views: Sequence[str] | None = None,
        *,
        max_hz: float = 5.0,
        columns: int = 2,
        height: int = 300,
        width: int = 1000,
        **feed_kw,
    ):
        super().__init__()
        self.feed = TraceFeed.of(engine_or_source, max_hz=max_hz, **feed_kw)
        self.header = W.HTML()
        self.views: dict[str, Any] = {}
        gap = 8
        cell = (width - gap * (columns - 1)) // columns
        for name in views or DEFAULT_VIEWS:
            self.views[name] = self._make_view(name, height, cell)
        cells = list(self.views.values())
        grid = W.GridBox(
            cells, layout=W.Layout(grid_template_columns=f"repeat({columns}, {cell}px)", grid_gap=f"{gap}px")
        )
        self.controls = self._controls()
        self.children = [self.header] + ([self.controls] if self.controls is not None else []) + [grid]
        self.add_class("workbench-dashboard")  # a stable hook for browser tests and custom CSS
        self.feed.attach(self._update_header)

    @staticmethod
    def compare(spec: str = "schedule_policy=fcfs,lpm", **kw):
        """Two simulated engines one engine setting apart ("FLAG=A,B"), side by side on one clock and
        one seeded arrival stream: Queues, Batch and radix tree each, where their steps admitted
        differently, TTFT CDFs overlaid (`workbench.widgets.compare.CompareDashboard`; kw: its)."""
        from workbench.widgets.compare import CompareDashboard

        return CompareDashboard(spec, **kw)

    @classmethod
    def from_trace(cls, path, **kw) -> Dashboard:
        """Replay a recording (`Recorder` JSONL, optionally .gz) with Play/slider controls."""
        return cls(str(path), **kw)

    # ---- views ------------------------------------------------------------------------------

    def _make_view(self, name: str, height: int, width: int):
        cls = VIEWS.get(name)
        if cls is not None:
            return cls(self.feed, height=height, width=width)
        from workbench.plugins import load_plugins

        spec = load_plugins().views.get(name)
        if spec is None:
            known = sorted(set(VIEWS) | set(load_plugins().views))
            raise ValueError(f"unknown view {name!r}; known views: {', '.join(known)}")
        view = spec.factory(self.feed)
        if hasattr(view, "update") and view not in self.feed._views:
            self.feed.attach(view)
        return view

    def __getitem__(self, name: str):
        return self.views[name]

    @property
    def state(self) -> TraceState:
        return self.feed.state

    # ---- header and controls ------------------------------------------------------------------

    def _update_header(self, state: TraceState, t0: int | None) -> None:
        s = D.summary(state)
        kv = f"{s['kv_used']}/{s['kv_total']} used, {s['kv_evictable']} evictable" if s["kv_total"] else "–"
        model = s["model"] or getattr(self.feed.engine, "trace_label", "") or "workbench"
        parts = [
            f"<b>{html.escape(model)}</b>",
            f"step {s['step'] if s['step'] is not None else '–'}",
            f"waiting {s['waiting']} · new {s['new']} · running {s['running']} · finished {s['finished']}"
            + (f" · aborted {s['aborted']}" if s["aborted"] else ""),
            f"cache hit {s['cache_hit_rate'] * 100:.0f}%",
            f"prefill {s['prefill_tps']:.0f} tok/s · decode {s['decode_tps']:.0f} tok/s",
            f"KV {kv}",
        ]
        if s["dropped"]:
            parts.append(f"<span style='color:#c00'>{s['dropped']} events dropped</span>")
        if self.feed.replay is not None:
            parts.append(f"replay step {self.feed.step_at(self.feed.replay.position_ns) + 1}/{self.feed.num_steps}")
        line = state.last_step_line
        last = f"<div class='workbench-laststep'><b>last step</b> {html.escape(line)}</div>" if line else ""
        self.header.value = "<div class='workbench-header'>" + " &nbsp;|&nbsp; ".join(parts) + "</div>" + last

    def _controls(self):
        if self.feed.replay is not None and self.feed.num_steps:
            n = self.feed.num_steps
            self.play = W.Play(min=0, max=n - 1, value=n - 1, step=1, interval=150, description="Play")
            self.slider = W.IntSlider(
                min=0,
                max=n - 1,
                value=n - 1,
                description="after step",
                continuous_update=True,
                layout=W.Layout(width="60%"),
            )
            W.jslink((self.play, "value"), (self.slider, "value"))
            self.slider.observe(lambda ch: self.feed.seek_step(ch["new"]), names="value")
            return W.HBox([self.play, self.slider])
        engine = self.feed.engine
        if engine is not None and hasattr(engine, "step_gate"):
            self.gate_label = W.Label("running")
            buttons = []
            for label, action in (("Pause", "pause"), ("Step", "step"), ("Resume", "resume")):
                b = W.Button(description=label, layout=W.Layout(width="90px"))
                b.on_click(lambda _b, a=action: self.gate(a))
                buttons.append(b)
            return W.HBox(buttons + [self.gate_label])
        return None

    def gate(self, action: str, steps: int = 1) -> dict:
        """Drive the engine's step gate ("pause" | "step" | "resume") and re-render."""
        res = self.feed.engine.step_gate(action, steps=steps)
        if hasattr(self, "gate_label"):
            self.gate_label.value = f"{'paused' if res.get('paused') else 'running'} at step {res.get('step')}"
        self.flush(timeout=1.0, quiet=0.15)
        return res

    # ---- static pictures ---------------------------------------------------------------------

    def snapshot(self, views: Sequence[str] | None = None, name: str = "", **kw):
        """Static pictures of this dashboard's views as they are now (default: those of its views that
        have one: gantt, batch, radix, kv, queues), under the header's line and the narrated last
        step. Unlike the live widgets, the picture stays in the notebook's saved outputs and does not
        move on with the engine: show one wherever the text talks about a moment.
        kw: see `workbench.widgets.static.snapshot` (width, max_requests, max_steps, ...)."""
        from workbench.widgets.static import STATIC_VIEWS

        if views is None:
            views = [v for v in self.views if v in STATIC_VIEWS]
        return self.feed.snapshot(tuple(views), name=name, **kw)

    # ---- lifecycle ---------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Re-render every view now."""
        self.feed.refresh()

    def flush(self, timeout: float = 3.0, quiet: float = 0.3) -> None:
        """Wait for the trace to go quiet (after a generate call), then re-render."""
        self.feed.flush(timeout=timeout, quiet=quiet)

    def stop(self) -> None:
        """Stop following the source; the widgets stay on the page with their last picture
        (call this before `engine.shutdown()` where the text still points at the views)."""
        self.flush(timeout=1.0, quiet=0.1)
        self.feed.close()
        if hasattr(self, "gate_label"):
            self.gate_label.value = "stopped"
            for b in self.controls.children:
                if isinstance(b, W.Button):
                    b.disabled = True

    def close(self) -> None:
        """Stop following the source and close the widgets (they vanish from the page: see stop())."""
        self.feed.close()
        super().close()
