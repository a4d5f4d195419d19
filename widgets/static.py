"""Static pictures of the views: SVG drawn from a TraceState, for outputs that must stay.

A live view (a FigureWidget) shows the state *now*, and only while its kernel and
widget manager are there. A notebook that talks about a moment (a request stalled
behind a chunked prefill, nodes locked by a running request, the cache after an
eviction) needs that moment kept: `snapshot(state, views)` draws the Gantt, the
batch composition, the radix tree, the KV pool and the queue lengths as plain SVG
inside one HTML block. It lands in the notebook's saved outputs (Run All, nbclient,
nbconvert), renders with no plotly.js, widget manager or kernel, and does not change
when the engine moves on. `Dashboard.snapshot`, `TraceFeed.snapshot` and
`TraceView.snapshot` take one of their own state.

Every drawn element carries data-* attributes (the span's kind and request, the
node's state, lock count and hits, the segment's step), so a test can read what a
picture shows. The numbers come from `workbench.widgets.data`, the same functions
the live views draw, and the colours from the one palette (core/trace/palette.py).
"""

from __future__ import annotations

import html
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from workbench.core.trace.palette import PALETTE as P
from workbench.core.trace.state import TraceState
from workbench.widgets import data as D

#: The views that have a static picture, in the order a snapshot draws them.
STATIC_VIEWS = ("gantt", "batch", "radix", "kv", "queues")

SPAN_COLORS = {"queued": P["waiting"], "prefill": P["computed"], "decode": P["decode"]}
BATCH_COLORS = {"cached": P["cached"], "computed": P["computed"], "decode": P["decode"]}
#: Radix node state (widgets.data.NODE_STATES) -> colour: a node just inserted holds freshly
#: computed tokens, a node with hits served them from the cache, any other unlocked node is evictable.
NODE_COLORS = {
    "root": "#ffffff",
    "evicted": P["evicted"],
    "locked": P["locked"],
    "new": P["computed"],
    "hit": P["cached"],
    "cached": P["evictable"],
}
NODE_LABELS = {
    "evicted": "evicted",
    "locked": "locked",
    "new": "new (computed)",
    "hit": "hit (cached)",
    "cached": "evictable",
}
KV_COLORS = {"used": P["locked"], "evictable": P["evictable"], "free": P["free"]}
# "new" (arrived, not yet queued) is waiting's colour, dotted: as in the live QueueView.
QUEUE_COLORS = {"waiting": P["waiting"], "new": P["waiting"], "running": P["decode"]}
INK, GRID, FONT = "#333333", "#bbb", "font-family:sans-serif;font-size:11px"
MARGIN = dict(l=64, r=12, t=40, b=34)  # room for row labels, the title + legend line, the x axis


_CONTROL = {c: None for c in range(32) if chr(c) not in "\t\n\r"}


def _esc(s: object) -> str:
    # Control characters (a tokenizer's odd bytes in a node's text) are not allowed in XML/SVG.
    return html.escape(str(s).translate(_CONTROL), quote=True)


def _data(**kw) -> str:
    return "".join(f' data-{k.replace("_", "-")}="{_esc(v)}"' for k, v in kw.items())


def _axis(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values; the first at or below lo, the last at or above hi."""
    if hi - lo < 1e-9:  # one sample: an axis around it, not a billion ticks of nothing
        hi = lo + max(abs(lo) * 0.1, 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first, last = math.floor(lo / step + 1e-9), max(math.ceil(hi / step - 1e-9), math.floor(lo / step + 1e-9) + 1)
    return [k * step for k in range(first, last + 1)]


def _fmt(v: float) -> str:
    return f"{v:g}" if abs(v) >= 1 or v == 0 else f"{v:.3g}"


class _Svg:
    """A small SVG writer: a plot area inside margins, a title, a legend, axes."""

    def __init__(self, view: str, width: int, height: int, title: str):
        self.view, self.w, self.h = view, width, height
        self.x0, self.y0 = MARGIN["l"], MARGIN["t"]
        self.pw, self.ph = width - MARGIN["l"] - MARGIN["r"], height - MARGIN["t"] - MARGIN["b"]
        self.parts: list[str] = [
            f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
            f'<text x="8" y="16" style="font-size:13px;font-weight:bold" fill="{INK}">{_esc(title)}</text>',
        ]

    def add(self, s: str) -> None:
        self.parts.append(s)

    def legend(self, items: Sequence[tuple[str, str]]) -> None:
        x = 8
        for label, colour in items:
            self.add(
                f'<rect x="{x}" y="24" width="10" height="10" fill="{colour}" stroke="#999"/>'
                f'<text x="{x + 14}" y="33" fill="{INK}">{_esc(label)}</text>'
            )
            x += 22 + 6.5 * len(label)

    def y_axis(self, hi: float, label: str, exact: bool = False):
        """Grid lines and labels from 0 to a round top at or above hi (exact: to hi itself, which
        gets a label of its own); returns value -> y."""
        ticks = _axis(0.0, hi)
        if exact:
            ticks = [v for v in ticks if v < hi * 0.93] + [hi]  # no round tick crowding the top label
        top = ticks[-1]
        for v in ticks:
            y = self.y0 + self.ph - v / top * self.ph
            self.add(
                f'<line x1="{self.x0}" x2="{self.x0 + self.pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="{GRID}" stroke-opacity="0.6"/>'
                f'<text x="{self.x0 - 4}" y="{y + 4:.1f}" text-anchor="end" fill="{INK}">{_fmt(v)}</text>'
            )
        self.add(
            f'<text transform="translate(12 {self.y0 + self.ph / 2:.0f}) rotate(-90)" text-anchor="middle" '
            f'fill="{INK}">{_esc(label)}</text>'
        )
        return lambda v: self.y0 + self.ph - min(max(v, 0.0), top) / top * self.ph

    def x_axis(self, lo: float, hi: float, label: str):
        """Ticks and labels over a round range covering [lo, hi]; returns value -> x."""
        ticks = _axis(lo, hi)
        a, b = ticks[0], ticks[-1]
        xs = lambda v: self.x0 + (min(max(v, a), b) - a) / (b - a) * self.pw  # noqa: E731
        for v in ticks:
            x = xs(v)
            self.add(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{self.y0 + self.ph}" y2="{self.y0 + self.ph + 4}" '
                f'stroke="{INK}"/><text x="{x:.1f}" y="{self.y0 + self.ph + 15}" text-anchor="middle" '
                f'fill="{INK}">{_fmt(round(v, 9))}</text>'
            )
        self.add(
            f'<text x="{self.x0 + self.pw / 2:.0f}" y="{self.h - 4}" text-anchor="middle" fill="{INK}">'
            f"{_esc(label)}</text>"
        )
        return xs

    def empty(self, why: str) -> None:
        self.add(f'<text x="{self.w / 2:.0f}" y="{self.h / 2:.0f}" text-anchor="middle" fill="#999">{_esc(why)}</text>')

    def render(self, **data) -> str:
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" class="workbench-snapshot-{self.view}" '
            f'width="{self.w}" height="{self.h}" viewBox="0 0 {self.w} {self.h}" style="{FONT}"'
            f"{_data(view=self.view, **data)}>" + "".join(self.parts) + "</svg>"
        )


# ---- the pictures ------------------------------------------------------------------------------


def gantt_svg(
    state: TraceState,
    t0: int | None = None,
    *,
    width: int = 900,
    height: int | None = None,
    max_requests: int = 40,
) -> str:
    """Request timeline: a row per request with its queued, prefill (one bar per chunk) and decode
    (one bar per run of consecutive steps: a gap is a stall) bars, a diamond at the first token and
    a tick at the finish. Each bar's tooltip tells its request, kind, steps and times."""
    t0 = _origin(state, t0)
    g = D.gantt_data(state, t0, max_requests)
    rows = len(g.rids)
    row_h = 18 if rows <= 16 else max(7, 300 // max(rows, 1))
    height = height or MARGIN["t"] + MARGIN["b"] + max(rows, 3) * row_h
    svg = _Svg("gantt", width, height, f"Requests: {rows} shown (time since the first event)")
    svg.legend([(k, SPAN_COLORS[k]) for k in D.SPAN_KINDS] + [("◆ first token", INK), ("| finished", INK)])
    if not rows:
        svg.empty("no requests yet")
        return svg.render(requests=0, spans=0)
    times = [s.start for s in g.spans] + [s.end for s in g.spans] + [t for _, t, _ in g.marks]
    # From the first request shown, not from t0: in a long session the 40 newest start late.
    xs = svg.x_axis(min(times), max(times), "time (s)")
    row = {rid: i for i, rid in enumerate(g.rids)}
    for rid, i in row.items():
        y = svg.y0 + i * row_h
        svg.add(
            f'<text x="{svg.x0 - 4}" y="{y + row_h * 0.7:.1f}" text-anchor="end" fill="{INK}"'
            f"{_data(rid=rid)}>{_esc(D.short_rid(rid))}</text>"
        )
    for s in g.spans:
        y = svg.y0 + row[s.rid] * row_h + row_h * 0.15
        x, w = xs(s.start), max(xs(s.end) - xs(s.start), 1.5)  # a one-step decode run stays visible
        steps = f"steps {s.steps[0]}–{s.steps[-1]}" if len(s.steps) > 1 else (f"step {s.steps[0]}" if s.steps else "")
        tip = f"{s.rid} {s.kind} {steps} {s.start:.3f}–{s.end:.3f} s {s.detail}".replace("  ", " ")
        svg.add(
            f'<rect class="span" x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" height="{row_h * 0.7:.1f}" '
            f'fill="{SPAN_COLORS[s.kind]}"{_data(kind=s.kind, rid=s.rid)}><title>{_esc(tip)}</title></rect>'
        )
    for rid, t, kind in g.marks:
        x, yc = xs(t), svg.y0 + row[rid] * row_h + row_h / 2
        r = row_h * 0.3
        if kind == "first_token":
            tag, attrs = (
                "polygon",
                (
                    f'points="{x:.1f},{yc - r:.1f} {x + r:.1f},{yc:.1f} {x:.1f},{yc + r:.1f} '
                    f'{x - r:.1f},{yc:.1f}" fill="{INK}"'
                ),
            )
        elif kind == "retracted":
            tag, attrs = (
                "polygon",
                (
                    f'points="{x + r:.1f},{yc - r:.1f} {x + r:.1f},{yc + r:.1f} '
                    f'{x - r:.1f},{yc:.1f}" fill="{P["retracted"]}" stroke="{INK}"'
                ),
            )
        elif kind == "aborted":
            tag, attrs = (
                "path",
                (
                    f'd="M{x - r:.1f},{yc - r:.1f}L{x + r:.1f},{yc + r:.1f}M{x - r:.1f},'
                    f'{yc + r:.1f}L{x + r:.1f},{yc - r:.1f}" stroke="{INK}" stroke-width="2"'
                ),
            )
        else:
            tag, attrs = (
                "line",
                (
                    f'x1="{x:.1f}" x2="{x:.1f}" y1="{yc - r * 1.6:.1f}" y2="{yc + r * 1.6:.1f}" '
                    f'stroke="{INK}" stroke-width="1.5"'
                ),
            )
        svg.add(
            f'<{tag} class="mark" {attrs}{_data(mark=kind, rid=rid)}>'
            f"<title>{_esc(f'{rid} {kind} at {t:.3f} s')}</title></{tag}>"
        )
    return svg.render(requests=rows, spans=len(g.spans))


def batch_svg(state: TraceState, *, width: int = 900, height: int = 260, max_steps: int = 80) -> str:
    """Per scheduler step, stacked: prefix tokens served from the cache, prompt tokens computed,
    decode tokens. An extend step is a tall green bar; a decode step one orange token per request."""
    b = D.batch_data(state, max_steps)
    n = len(b.steps)
    title = f"Batch composition: steps {b.steps[0]}–{b.steps[-1]}" if n else "Batch composition"
    svg = _Svg("batch", width, height, title)
    svg.legend(
        [
            ("cached (prefix hit)", BATCH_COLORS["cached"]),
            ("prefill computed", BATCH_COLORS["computed"]),
            ("decode", BATCH_COLORS["decode"]),
        ]
    )
    if not n:
        svg.empty("no scheduler steps yet")
        return svg.render(steps=0)
    totals = [c + p + d for c, p, d in zip(b.cached, b.computed, b.decode)]
    ys = svg.y_axis(max(totals + [1]), "tokens")
    slot = svg.pw / n
    every = max(1, math.ceil(n / 16))  # at most ~16 step labels
    for i, step in enumerate(b.steps):
        x = svg.x0 + i * slot + slot * 0.1
        y = svg.y0 + svg.ph
        tip = f"step {step}: {b.mode[i]}, batch {b.batch_size[i]}, {b.step_ms[i]:.1f} ms"
        for kind, v in (("cached", b.cached[i]), ("computed", b.computed[i]), ("decode", b.decode[i])):
            if v <= 0:
                continue
            h = ys(0) - ys(v)
            y -= h
            svg.add(
                f'<rect class="seg" x="{x:.1f}" y="{y:.1f}" width="{slot * 0.8:.1f}" height="{h:.1f}" '
                f'fill="{BATCH_COLORS[kind]}"{_data(kind=kind, step=step, tokens=v)}>'
                f"<title>{_esc(f'{tip}: {v} {kind}')}</title></rect>"
            )
        if i % every == 0:
            svg.add(
                f'<text x="{x + slot * 0.4:.1f}" y="{svg.y0 + svg.ph + 15}" text-anchor="middle" '
                f'fill="{INK}">{step}</text>'
            )
    svg.add(
        f'<text x="{svg.x0 + svg.pw / 2:.0f}" y="{height - 4}" text-anchor="middle" fill="{INK}">scheduler step</text>'
    )
    return svg.render(steps=n)


def tree_svg(state: TraceState, *, width: int = 900, height: int | None = None, row_h: int = 30) -> str:
    """The radix cache as an icicle, root on top: each node is as wide as the tokens under it
    (its own edge and its descendants'), coloured by state (locked by a running request, just
    inserted, hit, evictable, evicted); a locked node shows its lock count. Tooltips: the text."""
    d = D.tree_data(state)
    kids: dict[str, list[int]] = {}
    for i, p in enumerate(d.parents):
        kids.setdefault(p, []).append(i)
    size = [0] * len(d.ids)

    def total(i: int) -> int:  # every node at least 1, so a 0-token root or split stays visible
        size[i] = max(d.values[i], 1) + sum(total(k) for k in kids.get(d.ids[i], []))
        return size[i]

    total(0)
    boxes: list[tuple[int, float, float, int]] = []  # (index, x, width, depth)

    def place(i: int, x: float, w: float, depth: int) -> None:
        boxes.append((i, x, w, depth))
        cx = x
        for k in sorted(kids.get(d.ids[i], []), key=lambda k: int(d.ids[k]) if d.ids[k].isdigit() else 0):
            kw = w * size[k] / size[i]
            place(k, cx, kw, depth + 1)
            cx += kw

    plot_w = width - 16
    place(0, 8.0, plot_w, 0)
    depth = max(dp for *_, dp in boxes) + 1
    height = height or min(MARGIN["t"] + depth * row_h + 10, 640)  # a deep tree gets thinner rows
    row_h = min(row_h, (height - MARGIN["t"] - 10) / depth)
    locked = sum(1 for s in d.states if s == "locked")
    svg = _Svg(
        "radix",
        width,
        height,
        f"Radix cache: {len(d.ids) - 1} nodes, {sum(d.values)} tokens (evictable {state.evictable}, "
        f"protected {state.tree_protected_size}, {locked} nodes locked)",
    )
    svg.legend([(NODE_LABELS[k], c) for k, c in NODE_COLORS.items() if k != "root"])
    for i, x, w, dp in boxes:
        y = MARGIN["t"] + dp * row_h
        st = d.states[i]
        lock = f" [lock {d.lock_refs[i]}]" if d.lock_refs[i] > 0 and st != "root" else ""
        tip = (
            f"node {d.ids[i]}: {d.values[i]} tokens, lock_ref {d.lock_refs[i]}, hits {d.hits[i]}, {st}\n"
            f"{d.texts[i][:200]}"
        )
        attrs = _data(
            node=d.ids[i],
            parent=d.parents[i],
            state=st,
            tokens=d.values[i],
            lock=d.lock_refs[i],
            hits=d.hits[i],
            label=d.labels[i],
        )
        svg.add(
            f'<rect class="node" x="{x:.1f}" y="{y:.1f}" width="{max(w - 1, 0.5):.1f}" '
            f'height="{row_h - 2:.1f}" fill="{NODE_COLORS[st]}" stroke="#999"{attrs}>'
            f"<title>{_esc(tip)}</title></rect>"
        )
        label = d.labels[i] + lock
        chars = int((w - 6) / 6.2)
        if chars >= 3 and row_h >= 12:
            text = label if len(label) <= chars else label[: chars - 1] + "…"
            svg.add(
                f'<text x="{x + 3:.1f}" y="{y + row_h / 2 + 3:.1f}" fill="{INK}" pointer-events="none">'
                f"{_esc(text)}</text>"
            )
    return svg.render(nodes=len(d.ids) - 1, locked=locked)


def kv_svg(state: TraceState, t0: int | None = None, *, width: int = 900, height: int = 240) -> str:
    """The KV pool over time, stacked to its capacity: held by requests (used), kept by the radix
    cache (evictable), free. The axis is the pool's size, so a small `used` looks small."""
    t0 = _origin(state, t0)
    k = D.kv_data(state, t0)
    title = (
        f"KV pool: {k.used[-1]} used, {k.evictable[-1]} evictable, {k.free[-1]} free of {k.total[-1]} tokens"
        if k.t
        else "KV pool"
    )
    svg = _Svg("kv", width, height, title)
    svg.legend([(key, c) for key, c in KV_COLORS.items()])
    if not k.t:
        svg.empty("no kv.usage yet")
        return svg.render(points=0)
    _, hi = D.kv_axis_range(k)
    ys = svg.y_axis(hi, "tokens", exact=True)  # the axis is the pool: its top is the capacity
    t_hi = max(k.t[-1], (state.last_ts - t0) / 1e9 if state.last_ts else 0.0)  # the last value holds till now
    xs = svg.x_axis(k.t[0], t_hi, "time (s)")
    below = [0] * len(k.t)
    for key, vals in (("used", k.used), ("evictable", k.evictable), ("free", k.free)):
        upper = [b + v for b, v in zip(below, vals)]
        svg.add(
            f'<path class="area" d="{_step_area(k.t, below, upper, xs, ys, t_hi)}" fill="{KV_COLORS[key]}" '
            f'stroke="none"{_data(kind=key, last=vals[-1])}/>'
        )
        below = upper
    return svg.render(points=len(k.t), capacity=k.total[-1])


def queues_svg(state: TraceState, t0: int | None = None, *, width: int = 900, height: int = 220) -> str:
    """Waiting (queued for prefill), new (arrived, not yet queued) and running requests over time."""
    t0 = _origin(state, t0)
    q = D.queue_data(state, t0)
    svg = _Svg("queues", width, height, "Queue lengths")
    svg.legend([(key, c) for key, c in QUEUE_COLORS.items()])
    if not q.t:
        svg.empty("no queue.state yet")
        return svg.render(points=0)
    ys = svg.y_axis(max(q.waiting + q.new + q.running + [1]), "requests")
    xs = svg.x_axis(q.t[0], q.t[-1], "time (s)")
    for key, vals in (("waiting", q.waiting), ("new", q.new), ("running", q.running)):
        pts, prev = [], None
        for t, v in zip(q.t, vals):
            if prev is not None:
                pts.append(f"{xs(t):.1f},{ys(prev):.1f}")
            pts.append(f"{xs(t):.1f},{ys(v):.1f}")
            prev = v
        dash = ' stroke-dasharray="3 3"' if key == "new" else ""
        svg.add(
            f'<polyline class="line" points="{" ".join(pts)}" fill="none" stroke="{QUEUE_COLORS[key]}" '
            f'stroke-width="2"{dash}{_data(kind=key, max=max(vals))}/>'
        )
    return svg.render(points=len(q.t))


def _step_area(ts, lower, upper, xs, ys, t_end) -> str:
    """A stepped band between two series (each value holds until the next sample, as in the live view)."""
    top, bottom = [], []
    for i, t in enumerate(ts):
        t_next = ts[i + 1] if i + 1 < len(ts) else max(t_end, t)
        top += [f"{xs(t):.1f},{ys(upper[i]):.1f}", f"{xs(t_next):.1f},{ys(upper[i]):.1f}"]
        bottom += [f"{xs(t):.1f},{ys(lower[i]):.1f}", f"{xs(t_next):.1f},{ys(lower[i]):.1f}"]
    return "M" + " L".join(top + bottom[::-1]) + " Z"


def _origin(state: TraceState, t0: int | None) -> int:
    if t0 is not None:
        return t0
    o = D.time_origin(state)
    return o if o is not None else state.last_ts


# ---- the snapshot ---------------------------------------------------------------------------------

_DRAW = {"gantt": gantt_svg, "batch": batch_svg, "radix": tree_svg, "kv": kv_svg, "queues": queues_svg}
_TIMED = {"gantt", "kv", "queues"}


@dataclass
class Snapshot:
    """Static pictures of some views at one moment; in a notebook it shows as HTML with inline SVG.

    name: a label for the moment (written as `data-name`, so a test or a reader can find it).
    caption: the header line and the narrated last step, as plain text lines.
    svgs: view name -> SVG markup.
    meta: facts of the moment, written as data-* attributes too (step, finished, evicted tokens).
    """

    name: str
    caption: list[str]
    svgs: dict[str, str] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def _repr_html_(self) -> str:
        return self.html()

    def __repr__(self) -> str:
        return f"<Snapshot {self.name or '(unnamed)'}: {', '.join(self.svgs)}; {' | '.join(self.caption)}>"

    def html(self) -> str:
        """The picture as one HTML fragment (a div of inline SVGs, under its caption)."""
        cap = "".join(f"<div>{_esc(line)}</div>" for line in self.caption)
        body = "".join(f"<div>{s}</div>" for s in self.svgs.values())
        return (
            f'<div class="workbench-snapshot"{_data(name=self.name, views=",".join(self.svgs), **self.meta)} '
            f'style="{FONT};color:{INK}"><div class="workbench-snapshot-caption" '
            f'style="font-size:12px;margin:2px 0 6px 0">{cap}</div>'
            f'<div style="display:flex;flex-wrap:wrap;gap:8px">{body}</div></div>'
        )

    def svg(self, view: str) -> str:
        """One view's SVG markup."""
        return self.svgs[view]

    def save(self, path) -> None:
        """Write a standalone HTML page (or, for a path ending in .svg with one view, the SVG)."""
        text = (
            next(iter(self.svgs.values()))
            if str(path).endswith(".svg") and len(self.svgs) == 1
            else f"<!doctype html><meta charset='utf-8'><body>{self.html()}</body>"
        )
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def caption_lines(state: TraceState) -> list[str]:
    """What the Dashboard's header says, as text: the step, queue counts, cache, KV, and the last step."""
    s = D.summary(state)
    step = s["step"] if s["step"] is not None else "–"
    kv = f"KV {s['kv_used']} used, {s['kv_evictable']} evictable of {s['kv_total']}" if s["kv_total"] else "KV –"
    head = (
        f"after step {step} · waiting {s['waiting']} · new {s['new']} · running {s['running']} · "
        f"finished {s['finished']} · cache hit {s['cache_hit_rate'] * 100:.0f}% · {kv} · "
        f"evicted {state.counters.evicted_tokens_total} tokens so far"
    )
    line = state.last_step_line
    return [head] + ([f"last step: {line}"] if line else [])


def snapshot(
    state: TraceState,
    views: Sequence[str] = ("gantt", "batch", "radix"),
    *,
    name: str = "",
    t0: int | None = None,
    width: int = 900,
    **kw,
) -> Snapshot:
    """Draw `views` (any of STATIC_VIEWS) of `state` as it is now; `kw` goes to each view's
    drawing function that takes it (e.g. max_requests for the Gantt, max_steps for the batch)."""
    unknown = [v for v in views if v not in _DRAW]
    if unknown:
        raise ValueError(f"no static picture for {', '.join(unknown)}; static views: {', '.join(STATIC_VIEWS)}")
    svgs = {}
    for v in views:
        fn = _DRAW[v]
        params = inspect.signature(fn).parameters
        args = {k: val for k, val in kw.items() if k in params}
        if v in _TIMED:
            args["t0"] = t0
        svgs[v] = fn(state, width=width, **args)
    s = D.summary(state)
    meta = {
        "step": "" if s["step"] is None else s["step"],
        "finished": s["finished"],
        "evicted": state.counters.evicted_tokens_total,
    }
    return Snapshot(name, caption_lines(state), svgs, meta)
