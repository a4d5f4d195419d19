"""A request's life as a sequence diagram, drawn from its real trace events.

Lanes are the processes (TokenizerManager in the main process, Scheduler,
Detokenizer); time runs downwards. Every event the request caused is a dot in
the lane of the process that emitted it, and a hand-over between processes is
an arrow labelled with the ZMQ message that carried it:

    tokenizer --TokenizedGenerateReqInput--> scheduler
    scheduler --BatchTokenIDOut--> detokenizer --BatchStrOut--> tokenizer
"""
from __future__ import annotations

from typing import Iterable, Optional

from workbench.core.trace import events as ev

LANES = ("client", "tokenizer", "scheduler", "detokenizer")
LANE_TITLES = {"client": "client", "tokenizer": "TokenizerManager<br>(main process)",
               "scheduler": "Scheduler<br>(process)", "detokenizer": "Detokenizer<br>(process)"}


def request_events(events: Iterable[ev.Event], rid: str) -> list[ev.Event]:
    """The events about one request (scheduler steps it took part in included), by time."""
    out = []
    for e in events:
        if getattr(e, "rid", None) == rid:
            out.append(e)
        elif type(e) is ev.BatchStep and any(sr.rid == rid for sr in e.reqs):
            out.append(e)
    return sorted(out, key=lambda e: e.ts)


def _lane(e: ev.Event) -> str:
    base = e.proc.split(".")[0] if e.proc else ""
    return base if base in LANES else "tokenizer"


def _label(e: ev.Event, rid: str) -> str:
    kind = e.__struct_config__.tag
    if type(e) is ev.BatchStep:
        sr = next(s for s in e.reqs if s.rid == rid)
        what = (f"prefill {sr.computed} tok (+{sr.cached} cached)" if sr.computed else "decode 1 tok")
        return f"step {e.step} {e.mode}: {what}, batch {e.batch_size}"
    if type(e) is ev.ReqText:
        return f"req.text {e.delta!r}"
    if type(e) is ev.ReqScheduled:
        return f"req.scheduled chunk {e.chunk_index + 1}/{e.num_chunks}, hit {e.prefix_hit}"
    if type(e) is ev.CacheMatch:
        return f"cache.match {e.matched}/{e.prompt_tokens}"
    if type(e) is ev.ReqFinished:
        return f"req.finished ({e.reason}, TTFT {e.ttft * 1e3:.0f} ms)"
    return kind


def sequence_figure(events: Iterable[ev.Event], rid: str, max_text_events: int = 6, height: Optional[int] = None):
    """A plotly Figure: the request's events per process lane, hand-overs as labelled arrows.

    `max_text_events` keeps the diagram readable for long outputs (later req.text
    events and their steps are summarised, not drawn)."""
    import plotly.graph_objects as go

    evs = request_events(events, rid)
    if not evs:
        raise ValueError(f"no events for request {rid!r}")
    # Long generations: keep the first few token round trips and the finish.
    shown, texts = [], 0
    for e in evs:
        if type(e) is ev.ReqText:
            texts += 1
        if texts > max_text_events and type(e) in (ev.ReqText, ev.BatchStep):
            continue
        shown.append(e)
    t0 = shown[0].ts
    ms = [(e.ts - t0) / 1e6 for e in shown]
    x = {lane: i for i, lane in enumerate(LANES)}
    fig = go.Figure()
    for lane in LANES:
        fig.add_shape(type="line", x0=x[lane], x1=x[lane], y0=-max(ms) * 0.03, y1=max(ms) * 1.03 + 1,
                      line=dict(color="#bbb", dash="dot"))
    fig.add_scatter(x=[x[_lane(e)] for e in shown], y=ms, mode="markers+text",
                    text=[_label(e, rid) for e in shown], textposition="middle right",
                    marker=dict(size=9, color=["#4e79a7" if _lane(e) == "scheduler" else "#f28e2b"
                                               for e in shown]),
                    hovertemplate="%{text}<br>+%{y:.1f} ms<extra></extra>", showlegend=False)

    def arrow(x0, y0, x1, y1, text):
        fig.add_annotation(x=x1, y=y1, ax=x0, ay=y0, xref="x", yref="y", axref="x", ayref="y",
                           showarrow=True, arrowhead=3, arrowsize=1.2, arrowcolor="#555", text="")
        fig.add_annotation(x=(x0 + x1) / 2, y=(y0 + y1) / 2, text=f"<i>{text}</i>", showarrow=False,
                           font=dict(size=10, color="#555"), yshift=8)

    arrow(x["client"], 0, x["tokenizer"], 0, "generate()")
    prev = shown[0]
    for e, y in zip(shown[1:], ms[1:]):
        a, b = _lane(prev), _lane(e)
        y_prev = (prev.ts - t0) / 1e6
        if a == "tokenizer" and b == "scheduler":
            arrow(x[a], y_prev, x[b], y, "TokenizedGenerateReqInput")
        elif a == "scheduler" and b == "tokenizer":
            mid = (y_prev + y) / 2
            arrow(x[a], y_prev, x["detokenizer"], mid, "BatchTokenIDOut")
            arrow(x["detokenizer"], mid, x[b], y, "BatchStrOut")
        prev = e
    last = shown[-1]
    if type(last) is ev.ReqFinished:
        arrow(x["tokenizer"], ms[-1], x["client"], ms[-1], "result dict")
    fig.update_layout(
        height=height or max(360, 26 * len(shown) + 120), template="plotly_white",
        title=f"Request {rid[:8]}: {len(evs)} trace events" + (f" ({len(shown)} drawn)" if len(shown) < len(evs) else ""),
        xaxis=dict(tickvals=list(range(len(LANES))), ticktext=[LANE_TITLES[ln] for ln in LANES],
                   range=[-0.4, len(LANES) + 0.6], side="top", showgrid=False, zeroline=False),
        yaxis=dict(title="ms since arrival", autorange="reversed", zeroline=False),
        margin=dict(l=60, r=20, t=90, b=20))
    return fig
