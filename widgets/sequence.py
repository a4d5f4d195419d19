"""A request's life as a sequence diagram, drawn from its real trace events.

Lanes are the processes (TokenizerManager in the main process, Scheduler,
Detokenizer); time runs downwards. Every event the request caused is a dot in
the lane of the process that emitted it, and a hand-over between processes is
an arrow labelled with the ZMQ message that carried it:

    tokenizer --TokenizedGenerateReqInput--> scheduler
    scheduler --BatchTokenIDOut--> detokenizer --BatchStrOut--> tokenizer
"""

from __future__ import annotations

from collections.abc import Iterable

from workbench.core.trace import events as ev

LANES = ("client", "tokenizer", "scheduler", "detokenizer")
LANE_TITLES = {
    "client": "client",
    "tokenizer": "TokenizerManager<br>(main process)",
    "scheduler": "Scheduler<br>(process)",
    "detokenizer": "Detokenizer<br>(process)",
}


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
        what = f"prefill {sr.computed} tok (+{sr.cached} cached)" if sr.computed else "decode 1 tok"
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


def sequence_figure(events: Iterable[ev.Event], rid: str, max_text_events: int = 6, height: int | None = None):
    """A plotly Figure: one row per trace event of the request (in time order, the time on the
    left), in the lane of the process that emitted it; hand-overs between processes are arrows
    labelled with the ZMQ message that carried them.

    `max_text_events` keeps the diagram readable for long outputs (later token round trips
    are summarised in the title, not drawn)."""
    import plotly.graph_objects as go

    evs = request_events(events, rid)
    if not evs:
        raise ValueError(f"no events for request {rid!r}")
    shown, texts = [], 0
    for e in evs:
        if type(e) is ev.ReqText:
            texts += 1
        if texts > max_text_events and type(e) in (ev.ReqText, ev.BatchStep):
            continue
        shown.append(e)
    t0 = shown[0].ts
    x = {lane: i for i, lane in enumerate(LANES)}
    rows = list(range(1, len(shown) + 1))  # row 0: the client's call
    fig = go.Figure()
    last_row = len(shown) + 1
    for lane in LANES:
        fig.add_shape(
            type="line",
            x0=x[lane],
            x1=x[lane],
            y0=-0.5,
            y1=last_row + 0.5,
            line=dict(color="#bbb", dash="dot"),
            layer="below",
        )
    fig.add_scatter(
        x=[x[_lane(e)] for e in shown],
        y=rows,
        mode="markers+text",
        text=[_label(e, rid) for e in shown],
        # scheduler labels on the left: the messages to the detokenizer leave to the right
        textposition=["middle left" if _lane(e) == "scheduler" else "middle right" for e in shown],
        textfont=dict(size=11),
        marker=dict(size=9, color=["#333333" if _lane(e) == "scheduler" else "#999999" for e in shown]),
        hoverinfo="skip",
        showlegend=False,
    )

    labelled: set[str] = set()

    def arrow(x0, y0, x1, y1, text):
        fig.add_annotation(
            x=x1,
            y=y1,
            ax=x0,
            ay=y0,
            xref="x",
            yref="y",
            axref="x",
            ayref="y",
            showarrow=True,
            arrowhead=3,
            arrowsize=1.1,
            arrowwidth=1.2,
            arrowcolor="#666",
            text="",
        )
        if text in labelled:  # name each kind of message once; repeats are the same message
            return
        labelled.add(text)
        fig.add_annotation(
            x=(x0 + x1) / 2,
            y=(y0 + y1) / 2,
            text=f"<i>{text}</i>",
            showarrow=False,
            font=dict(size=10, color="#666"),
            yshift=9,
        )

    arrow(x["client"], 0, x["tokenizer"], 1, "generate()")
    for i, e in enumerate(shown):
        row = rows[i]
        if type(e) is ev.ReqQueued:
            src = next((j for j in range(i - 1, -1, -1) if _lane(shown[j]) == "tokenizer"), None)
            if src is not None:
                arrow(x["tokenizer"], rows[src], x["scheduler"], row, "TokenizedGenerateReqInput")
        elif type(e) is ev.BatchStep:
            dst = next((j for j in range(i + 1, len(shown)) if _lane(shown[j]) == "tokenizer"), None)
            if dst is not None:
                mid = (row + rows[dst]) / 2
                arrow(x["scheduler"], row, x["detokenizer"], mid, "BatchTokenIDOut")
                arrow(x["detokenizer"], mid, x["tokenizer"], rows[dst], "BatchStrOut")
    if type(shown[-1]) is ev.ReqFinished:
        arrow(x["tokenizer"], rows[-1], x["client"], last_row, "result")
    omitted = len(evs) - len(shown)
    fig.update_layout(
        height=height or 90 + 28 * (last_row + 1),
        template="plotly_white",
        showlegend=False,
        title=dict(
            text=f"Request {rid[:8]}: {len(evs)} trace events"
            + (f" ({omitted} later token round trips not drawn)" if omitted else ""),
            x=0.01,
        ),
        xaxis=dict(
            tickvals=list(range(len(LANES))),
            ticktext=[LANE_TITLES[ln] for ln in LANES],
            range=[-0.3, len(LANES) - 0.2],
            side="top",
            showgrid=False,
            zeroline=False,
        ),
        yaxis=dict(
            tickvals=rows,
            ticktext=[f"+{(e.ts - t0) / 1e6:.1f} ms" for e in shown],
            range=[last_row + 0.7, -0.7],
            showgrid=False,
            zeroline=False,
        ),
        margin=dict(l=80, r=20, t=90, b=10),
    )
    return fig
