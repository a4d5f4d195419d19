"""The Jupyter views: each an ipywidget (a VBox holding a plotly FigureWidget) that draws a TraceState.

Every view can be used alone — `GanttView(engine)`, `BatchView("run.jsonl")` —
or inside a `Dashboard`, which gives all of them one shared `TraceFeed`.
`update(state, t0)` redraws from the state inside one `batch_update()`, so a
refresh is a single message to the browser; the data come from
`workbench.widgets.data`, which is where the tests look too.
"""

from __future__ import annotations

import html
import threading
from copy import deepcopy
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from traitlets import observe
from workbench.core.trace.palette import METRIC_COLORS
from workbench.core.trace.palette import PALETTE as P
from workbench.core.trace.state import TraceState
from workbench.core.trace.views import format_priority
from workbench.widgets import data as D
from workbench.widgets.feed import RENDER_LOCK, TraceFeed

# Radix node colours and legend words are shared with the static pictures.
from workbench.widgets.static import NODE_COLORS, NODE_LABELS

# Every colour with a meaning comes from the one palette the TUI uses too (core/trace/palette.py).
COLORS = {
    "queued": P["waiting"],
    "prefill": P["computed"],
    "decode": P["decode"],
    "cached": P["cached"],
    "computed": P["computed"],
    "used": P["locked"],
    "evictable": P["evictable"],
    "free": P["free"],
    "waiting": P["waiting"],
    "running": P["decode"],
    "retracted": P["retracted"],
    **METRIC_COLORS,
}
MARK_COLOR = "#333333"
MARK_SYMBOLS = {"first_token": "diamond", "finished": "line-ns-open", "aborted": "x", "retracted": "triangle-left"}


class TraceFigure(go.FigureWidget):
    """A FigureWidget that applies messages from the browser under RENDER_LOCK.

    plotly sends each update to the browser as a pulse: a synced trait set to the
    message, then back to None. ipywidgets applies a browser message (plotly's
    acknowledgements arrive after every update) inside traitlets'
    `hold_trait_notifications`, which swaps the *instance's* notifier for one that
    compresses consecutive changes of a trait — on every thread. A pulse from the
    feed thread landing in that window becomes None -> None and never reaches the
    browser. Taking the render lock here makes the two mutually exclusive.
    """

    def set_state(self, sync_data):
        with RENDER_LOCK:
            super().set_state(sync_data)

    @observe("_view_count")
    def _on_new_view(self, change) -> None:
        """A browser drew a new view of this figure (plotly counts views in `_view_count`): send it
        the whole figure. The view started from the synced state, which may predate updates the
        browser dropped while plotly's script loaded; with the run over, no other update would come
        (issue #40 item 12). Sent from a timer, after the browser's message is applied (see above)."""
        if (change["new"] or 0) > (change["old"] or 0):
            timer = threading.Timer(0.05, self._send_whole)
            timer.daemon = True
            timer.start()

    def _send_whole(self) -> None:
        with RENDER_LOCK:
            sync_figure_state(self)
            send_figure(self)


def _layout(title: str, height: int, width: int | None, **kw) -> dict:
    lay = dict(
        title=dict(text=title, x=0.01, font=dict(size=14)),
        height=height,
        margin=dict(l=60, r=20, t=36, b=72),
        template="plotly_white",
        legend=dict(orientation="h", yanchor="top", y=-0.3, x=0),
    )
    if width:
        lay["width"] = width
    lay.update(kw)
    return lay


class TraceView(W.VBox):
    """Base of the views: owns `figure` (a FigureWidget); `update(state, t0)` redraws it.

    Args:
        source: optional; anything `TraceFeed` accepts (an Engine, a recording's
            path, a Replay, a list of events, a TraceState) or a TraceFeed to share.
        height, width: figure size in pixels (width None: fill the cell).
    """

    name = ""
    title = ""

    def __init__(self, source: Any = None, *, height: int = 320, width: int | None = None, **kw):
        super().__init__()
        self.figure = TraceFigure()
        self._build(height, width, **kw)
        self.children = [self.figure] + self._extras()
        self.add_class("workbench-view")
        if self.name:
            self.add_class(f"workbench-view-{self.name}")
        self.feed: TraceFeed | None = None
        if source is not None:
            self.feed = TraceFeed.of(source)
            self.feed.attach(self)

    def _build(self, height: int, width: int | None, **kw) -> None:
        raise NotImplementedError

    def _extras(self) -> list:
        return []

    def update(self, state: TraceState, t0: int | None = None) -> None:
        """Redraw from `state`; times are relative to t0 (default: the state's own origin)."""
        if t0 is None:
            t0 = D.time_origin(state) or state.last_ts
        with RENDER_LOCK, self.figure.batch_update():
            self._draw(state, t0)

    def _draw(self, state: TraceState, t0: int) -> None:
        raise NotImplementedError

    def snapshot(self, name: str = "", **kw):
        """A static picture of this view now (`widgets.static.Snapshot`): it stays in the notebook's
        outputs after the engine, the kernel or this widget is gone. kw: see `static.snapshot`."""
        if self.feed is None:
            raise RuntimeError("this view has no source of its own: snapshot its Dashboard or TraceFeed")
        return self.feed.snapshot((self.name,), name=name, **kw)

    def keyframe(self) -> None:
        """Re-send the whole figure to the browser, not only what changed since the last render,
        and make it the figure's synced state (what a view rendered later starts from).

        The browser applies an update only once the widget's code has loaded; one sent
        earlier is dropped there, and since renders send only changed properties, what
        it carried would stay missing. A live feed calls this every few seconds, after a run
        and when a view is attached."""
        sync_figure_state(self.figure)
        send_figure(self.figure)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "template":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def sync_figure_state(fig: go.FigureWidget) -> None:
    """Make the figure's synced state (`_widget_data`, `_widget_layout`: what plotly's browser code
    draws a new view from) the whole figure as it is now.

    plotly sets that state once, when the figure is made (here: empty traces), and afterwards
    only sends updates, which the browser drops until the widget's 5 MB script has loaded. A
    Dashboard displayed while the engine was idle got its last updates before that: 5 of 6 plots
    stayed empty for minutes (issue #40 item 12). The state, unlike an update, is kept by the
    browser's widget model whenever it arrives, so a view drawn after this starts complete."""
    if not hasattr(fig, "_widget_data"):
        return
    with RENDER_LOCK:
        fig._widget_layout = deepcopy(fig._layout_obj._props)
        fig._widget_data = deepcopy(fig._data)


def send_figure(fig: go.FigureWidget) -> None:
    """One update message carrying every trace property and the whole layout."""
    send = getattr(fig, "_send_update_msg", None)  # plotly's own sender (plotly >= 4)
    if send is None or not fig.data:
        return
    traces = [{k: v for k, v in _flatten(t.to_plotly_json()).items() if k not in ("type", "uid")} for t in fig.data]
    style = {k: [t.get(k) for t in traces] for k in sorted(set().union(*traces))}
    with RENDER_LOCK:
        send(style, _flatten(fig.layout.to_plotly_json()), list(range(len(fig.data))))


# ---- Gantt ------------------------------------------------------------------------------


class GanttView(TraceView):
    """Request timeline: one row per request; bars for queued, each prefill chunk, decode runs;
    markers for the first token and the finish. Click a bar for the request's details."""

    name = "gantt"
    title = "Requests"

    def _build(self, height, width, max_requests: int = 40):
        self.max_requests = max_requests
        self._state: TraceState | None = None
        self.selected: str | None = None
        for kind in D.SPAN_KINDS:
            self.figure.add_bar(
                name=kind,
                orientation="h",
                marker_color=COLORS[kind],
                x=[],
                y=[],
                base=[],
                customdata=[],
                hovertemplate="%{customdata[0]}<br>%{customdata[1]}"
                "<br>%{base:.3f}s + %{x:.3f}s<extra>" + kind + "</extra>",
            )
        self.figure.add_scatter(
            name="events",
            mode="markers",
            x=[],
            y=[],
            customdata=[],
            marker=dict(color=MARK_COLOR, size=9, symbol=[]),
            hovertemplate="%{customdata[0]}: %{customdata[1]} at %{x:.3f}s<extra></extra>",
        )
        self.figure.update_layout(
            **_layout(self.title, height, width, barmode="overlay", xaxis_title="time (s)", clickmode="event")
        )
        self.figure.update_yaxes(autorange="reversed", type="category")
        for tr in self.figure.data:
            tr.on_click(self._on_click)
        self.details = W.HTML(value="<i>click a bar for the request's details</i>")

    def _extras(self):
        return [self.details]

    def _draw(self, state, t0):
        self._state = state
        g = D.gantt_data(state, t0, self.max_requests)
        label = {rid: D.short_rid(rid) for rid in g.rids}
        for tr, kind in zip(self.figure.data, D.SPAN_KINDS):
            sp = [s for s in g.spans if s.kind == kind]
            tr.y = [label[s.rid] for s in sp]
            tr.base = [s.start for s in sp]
            tr.x = [s.end - s.start for s in sp]
            # The queued bar's hover is the TTFT parts before the prefill (lines of text).
            tr.customdata = [[s.rid, _hover(s.detail) if kind == "queued" else s.detail] for s in sp]
        m = self.figure.data[len(D.SPAN_KINDS)]
        m.x = [t for _, t, _ in g.marks]
        m.y = [label[rid] for rid, _, _ in g.marks]
        # The first-token marker's hover: the whole TTFT, part by part.
        m.customdata = [
            [rid, kind + "<br>" + _hover("\n".join(g.ttft[rid])) if kind == "first_token" and rid in g.ttft else kind]
            for rid, _, kind in g.marks
        ]
        m.marker.symbol = [MARK_SYMBOLS[k] for _, _, k in g.marks]
        m.marker.color = [COLORS["retracted"] if k == "retracted" else MARK_COLOR for _, _, k in g.marks]
        self.figure.layout.yaxis.categoryarray = [label[r] for r in g.rids]
        self.figure.layout.yaxis.categoryorder = "array"
        if self.selected is not None:
            self.details.value = details_html(state, self.selected)

    def _on_click(self, trace, points, _selector):
        if points.point_inds:
            self.select(trace.customdata[points.point_inds[0]][0])

    def select(self, rid: str) -> None:
        """Show one request's details below the chart."""
        self.selected = rid
        if self._state is not None:
            self.details.value = details_html(self._state, rid)


def _hover(text: str) -> str:
    """Plain text lines as plotly hover markup (which reads <br>, and HTML entities)."""
    return html.escape(text).replace("\n", "<br>")


def details_html(state: TraceState, rid: str) -> str:
    d = D.request_details(state, rid)
    if not d:
        return f"<i>request {html.escape(rid)} is no longer in the trace</i>"
    fmt = lambda v: "–" if v is None else (f"{v * 1e3:.1f} ms" if isinstance(v, float) else str(v))  # noqa: E731
    facts = " · ".join(
        f"<b>{k}</b> {html.escape(fmt(d[k]))}"
        for k in (
            "state",
            "prompt_tokens",
            "cached_tokens",
            "computed_tokens",
            "output_tokens",
            "finish_reason",
            "ttft",
            "tpot",
            "e2e",
        )
    )
    if d["constraint"]:
        facts += f" · <b>constrained by</b> {html.escape(d['constraint'].replace('_', ' '))}"
    if d.get("priority") is not None:  # priority scheduling
        facts += f" · <b>priority</b> {html.escape(format_priority(d['priority']))}"
    if d.get("preempted"):
        facts += f" · <b>{html.escape(d['preempted'])}</b>"
    t0 = d["timeline"][0][0] if d["timeline"] else 0
    rows = "".join(
        f"<tr><td>+{(ts - t0) / 1e6:.1f} ms</td><td>{html.escape(k)}</td><td>{html.escape(det)}</td></tr>"
        for ts, k, det in d["timeline"]
    )
    parts = d["ttft_parts"]
    ttft = (
        (
            f"<div class='workbench-ttft'><b>{html.escape(parts[0])}</b>"
            + "".join(f"<br>&nbsp;&nbsp;{html.escape(ln)}" for ln in parts[1:])
            + "</div>"
        )
        if parts
        else ""
    )
    return (
        f"<div><b>{html.escape(rid)}</b>: {html.escape(d['prompt'][:80])}<br>{facts}{ttft}"
        f"<br>output: <code>{html.escape(d['text'][-200:])}</code>"
        f"<table style='font-size:90%'>{rows}</table></div>"
    )


# ---- batch composition ------------------------------------------------------------------


class BatchView(TraceView):
    """Per scheduler step: stacked cached / computed-prefill / decode tokens, the step time on a
    second axis, and a star where decode ran through a CUDA graph. Click a bar for the step's
    whole decision (what was admitted, released, evicted, retracted, and why the rest wait)."""

    name = "batch"
    title = "Batch composition per step"

    def _build(self, height, width, max_steps: int = 200):
        self.max_steps = max_steps
        self._state: TraceState | None = None
        self.selected_step: int | None = None
        self.details = W.HTML(value="<i>click a bar for that step's whole decision</i>")
        for key, label in (("cached", "cached (prefix hit)"), ("computed", "prefill computed"), ("decode", "decode")):
            self.figure.add_bar(
                name=label,
                x=[],
                y=[],
                marker_color=COLORS.get(key, COLORS["decode"]),
                customdata=[],
                hovertemplate="step %{x}: %{y} tokens<br>%{customdata}<extra>" + label + "</extra>",
            )
        self.figure.add_scatter(
            name="step time (ms)",
            x=[],
            y=[],
            yaxis="y2",
            mode="lines+markers",
            line=dict(color="#555", width=1),
            marker=dict(size=3),
        )
        self.figure.add_scatter(
            name="CUDA graph", x=[], y=[], mode="markers", marker=dict(symbol="star", size=9, color=MARK_COLOR)
        )
        self.figure.update_layout(
            **_layout(
                self.title,
                height,
                width,
                barmode="stack",
                xaxis_title="scheduler step",
                yaxis=dict(title="tokens"),
                yaxis2=dict(title="ms", overlaying="y", side="right", showgrid=False, rangemode="tozero"),
                clickmode="event",
            )
        )
        for tr in self.figure.data[:3]:
            tr.on_click(self._on_click)

    def _extras(self):
        return [self.details]

    def _on_click(self, trace, points, _selector):
        if points.point_inds:
            self.select_step(int(trace.x[points.point_inds[0]]))

    def select_step(self, step: int) -> None:
        """Show one step's whole decision below the chart (as the TUI's step history does)."""
        self.selected_step = step
        if self._state is not None:
            self.details.value = step_html(self._state, step)

    def _draw(self, state, t0):
        self._state = state
        if self.selected_step is not None:  # live: its decision may come after its step
            self.details.value = step_html(state, self.selected_step)
        b = D.batch_data(state, self.max_steps)
        hover = [
            f"{m}, batch {bs} (padded {ps}), {'CUDA graph' if g else 'eager'}, {be}"
            for m, bs, ps, g, be in zip(b.mode, b.batch_size, b.padded_size, b.cuda_graph, b.backend)
        ]
        for tr, ys in zip(self.figure.data[:3], (b.cached, b.computed, b.decode)):
            tr.x, tr.y, tr.customdata = b.steps, ys, hover
        self.figure.data[3].x, self.figure.data[3].y = b.steps, b.step_ms
        g = [i for i, c in enumerate(b.cuda_graph) if c]
        self.figure.data[4].x = [b.steps[i] for i in g]
        self.figure.data[4].y = [b.cached[i] + b.computed[i] + b.decode[i] for i in g]


def step_html(state: TraceState, step: int) -> str:
    """A step's decision rows (TraceState.describe) as a small HTML table."""
    sv = next((s for s in reversed(state.steps) if s.step == step), None)
    if sv is None:
        return f"<i>step {step} is no longer in the trace</i>"
    rows = "".join(
        f"<tr><td style='text-align:left'><b>{html.escape(h)}</b></td><td style='text-align:left'>"
        f"{html.escape(t)}</td></tr>"
        for h, t in state.describe(sv)
    )
    return f"<div class='workbench-step'><table style='font-size:90%'>{rows}</table></div>"


# ---- radix tree -------------------------------------------------------------------------------


class RadixTreeView(TraceView):
    """The radix prefix cache as an icicle (or treemap): area = tokens on each edge,
    colour = state (locked by a running request, just inserted, hit, evicted)."""

    name = "radix"
    title = "Radix cache"

    def _build(self, height, width, kind: str = "icicle"):
        trace = go.Icicle if kind == "icicle" else go.Treemap
        self.figure.add_trace(
            trace(
                ids=[],
                parents=[],
                values=[],
                labels=[],
                branchvalues="remainder",
                customdata=[],
                marker=dict(colors=[]),
                root=dict(color="#ffffff"),
                hovertemplate="%{customdata[4]}<br>node %{customdata[0]}: %{customdata[1]} tokens"
                "<br>lock_ref %{customdata[2]}, hits %{customdata[3]}<br>%{customdata[5]}<extra></extra>",
            )
        )
        self.figure.update_layout(**_layout(self.title, height, width, margin=dict(l=10, r=10, t=36, b=10)))
        legend = " ".join(
            f"<span style='background:{c};padding:0 6px;border:1px solid #999'>&nbsp;</span> {NODE_LABELS[k]}"
            for k, c in NODE_COLORS.items()
            if k != "root"
        )
        self.caption = W.HTML(value=f"<small>{legend}</small>")

    def _extras(self):
        return [self.caption]

    def _draw(self, state, t0):
        d = D.tree_data(state)
        tr = self.figure.data[0]
        tr.ids, tr.parents, tr.values, tr.labels = d.ids, d.parents, d.values, d.labels
        tr.marker.colors = [NODE_COLORS[s] for s in d.states]
        tr.customdata = [
            [i, v, lr, h, s, html.escape(t[:120])]
            for i, v, lr, h, s, t in zip(d.ids, d.values, d.lock_refs, d.hits, d.states, d.texts)
        ]
        self.figure.layout.title.text = (
            f"{self.title}: {len(d.ids) - 1} nodes, {sum(d.values)} tokens "
            f"(evictable {state.evictable}, "
            f"protected {state.tree_protected_size})"
        )


# ---- KV pool and queues over time ---------------------------------------------------------------


class KVPoolView(TraceView):
    """KV pool over time, stacked: held by requests (used), kept by the radix cache (evictable),
    free (hidden until clicked in the legend). The y axis is the pool's capacity, so the height
    of used + evictable is the share of the pool they take."""

    name = "kv"
    title = "KV pool"

    def _build(self, height, width):
        for key in ("used", "evictable", "free"):
            self.figure.add_scatter(
                name=key,
                x=[],
                y=[],
                mode="lines",
                stackgroup="kv",
                line=dict(width=0.5, color=COLORS[key], shape="hv"),
                visible="legendonly" if key == "free" else True,
            )
        self.figure.update_layout(**_layout(self.title, height, width, xaxis_title="time (s)", yaxis_title="tokens"))

    def _draw(self, state, t0):
        k = D.kv_data(state, t0)
        for tr, ys in zip(self.figure.data, (k.used, k.evictable, k.free)):
            tr.x, tr.y = k.t, ys
        self.figure.layout.yaxis.range = D.kv_axis_range(k)
        if k.total:
            self.figure.layout.title.text = (
                f"{self.title}: {k.used[-1]} used, {k.evictable[-1]} evictable, "
                f"{k.free[-1]} free of {k.total[-1]} tokens"
            )


class QueueView(TraceView):
    """Queue lengths over time: waiting (queued for prefill), running, and new (arrived at the
    tokenizer, not yet queued by the scheduler; dotted)."""

    name = "queues"
    title = "Queue lengths"

    def _build(self, height, width):
        for key in ("waiting", "running"):
            self.figure.add_scatter(name=key, x=[], y=[], mode="lines", line=dict(color=COLORS[key], shape="hv"))
        self.figure.add_scatter(
            name="new", x=[], y=[], mode="lines", line=dict(color=COLORS["waiting"], shape="hv", dash="dot")
        )
        self.figure.update_layout(**_layout(self.title, height, width, xaxis_title="time (s)", yaxis_title="requests"))

    def _draw(self, state, t0):
        q = D.queue_data(state, t0)
        self.figure.data[0].x, self.figure.data[0].y = q.t, q.waiting
        self.figure.data[1].x, self.figure.data[1].y = q.t, q.running
        self.figure.data[2].x, self.figure.data[2].y = q.t, q.new


# ---- latency ---------------------------------------------------------------------------------


class LatencyView(TraceView):
    """TTFT / TPOT / E2E ECDFs of finished requests, and arrival time vs TTFT."""

    name = "latency"
    title = "Latency"

    def _build(self, height, width):
        fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], subplot_titles=("ECDF", "arrival vs TTFT"))
        for m in ("ttft", "tpot", "e2e"):
            fig.add_scatter(
                name=m.upper(), x=[], y=[], mode="lines", line=dict(shape="hv", color=COLORS[m]), row=1, col=1
            )
        fig.add_scatter(
            name="requests",
            x=[],
            y=[],
            mode="markers",
            customdata=[],
            marker=dict(color=COLORS["ttft"], size=7),
            hovertemplate="%{customdata}: arrived %{x:.3f}s, TTFT %{y:.3f}s<extra></extra>",
            row=1,
            col=2,
        )
        self.figure = TraceFigure(fig)
        self.figure.update_layout(**_layout(self.title, height, width))
        self.figure.update_xaxes(title_text="seconds", row=1, col=1)
        self.figure.update_yaxes(title_text="fraction", range=[0, 1.02], row=1, col=1)
        self.figure.update_xaxes(title_text="arrival (s)", row=1, col=2)
        self.figure.update_yaxes(title_text="TTFT (s)", rangemode="tozero", row=1, col=2)

    def _draw(self, state, t0):
        lat = D.latency_data(state, t0)
        for tr, m in zip(self.figure.data[:3], ("ttft", "tpot", "e2e")):
            tr.x, tr.y = lat.ecdf[m]
        sc = self.figure.data[3]
        sc.x, sc.y, sc.customdata = lat.arrival, lat.ttft, lat.rids


#: The built-in views by name, in the Dashboard's order.
# ---- experts (mixture-of-experts models) -----------------------------------------------------------


class ExpertsView(TraceView):
    """Tokens per (layer, expert) of a mixture-of-experts model as a heatmap: over every step, the
    last step, or one request's own tokens (the selector under the figure). Not in the Dashboard's
    defaults (dense models have no experts): `Dashboard(engine, views=[..., "experts"])` or alone."""

    name = "experts"
    title = "Experts"

    def _build(self, height, width):
        self.figure.add_heatmap(
            z=[], x=[], y=[], colorscale="Oranges", hovertemplate="%{y}, expert %{x}: %{z} tokens<extra></extra>"
        )
        self.figure.update_layout(
            **_layout(
                self.title, height, width, xaxis_title="expert", yaxis=dict(title="sparse layer", autorange="reversed")
            )
        )
        self.which = W.Dropdown(options=list(D.EXPERT_MAPS), value=D.EXPERT_MAPS[0], description="show")
        self.which.observe(lambda _: None if self._syncing else self._redraw(), names="value")
        self._state: TraceState | None = None
        self._syncing = False  # the selector's choices are being refreshed by a draw, not by a user

    def _extras(self) -> list:
        return [self.which]

    def _redraw(self) -> None:
        if self._state is not None:
            self.update(self._state)

    def _draw(self, state, t0):
        self._state = state
        d = D.expert_data(state, self.which.value)
        options = list(D.EXPERT_MAPS) + d.rids
        if list(self.which.options) != options:
            keep = self.which.value if self.which.value in options else D.EXPERT_MAPS[0]
            self._syncing = True
            try:
                self.which.options = options
                self.which.value = keep
            finally:
                self._syncing = False
        hm = self.figure.data[0]
        hm.z, hm.x, hm.y = d.z, d.experts, d.layers
        self.figure.layout.title.text = d.title


VIEWS = {
    cls.name: cls for cls in (GanttView, BatchView, RadixTreeView, KVPoolView, QueueView, LatencyView, ExpertsView)
}
