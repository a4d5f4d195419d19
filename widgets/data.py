"""What each view draws, computed from a TraceState alone (no plotly, no ipywidgets).

Every view in this package is a thin plotly renderer over one function here,
so the numbers on screen are testable without a browser or a kernel: the
headless tests compare these (and the FigureWidget data built from them) with
what TraceState says. Times are seconds relative to an origin `t0` (monotonic
ns) that the caller keeps stable across renders.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workbench.core.trace import ttft as T
from workbench.core.trace.experts import imbalance
from workbench.core.trace.state import TraceState
from workbench.core.trace.views import StepView

#: Gantt span kinds, in drawing order.
SPAN_KINDS = ("queued", "prefill", "decode")
#: Radix node states, in priority order (the first that applies colours the node).
NODE_STATES = ("evicted", "locked", "new", "hit", "cached")


def time_origin(state: TraceState) -> int | None:
    """The earliest moment any view has something to draw at (monotonic ns), or None."""
    cands = [r.arrival_ts if r.arrival_ts is not None else r.queued_ts for r in state.requests.values()]
    if state.steps:
        cands.append(step_start(state.steps[0]))
    if state.kv_history:
        cands.append(state.kv_history[0].ts)
    if state.queue_history:
        cands.append(state.queue_history[0].ts)
    cands = [c for c in cands if c is not None]
    return min(cands) if cands else None


def step_start(sv: StepView) -> int:
    """When a step began (its batch.decision's start_ts; without one, its batch.step, stamped at the
    end, less the scheduling and forward time): the same moment the TTFT parts use."""
    return T.step_start(sv)


def _sec(ts: int, t0: int) -> float:
    return (ts - t0) / 1e9


def short_rid(rid: str, n: int = 8) -> str:
    return rid if len(rid) <= n else rid[:n]


# ---- Gantt ---------------------------------------------------------------------


@dataclass
class Span:
    """One horizontal bar of the request Gantt chart."""

    rid: str
    kind: str  # "queued" | "prefill" | "decode"
    start: float  # s since t0
    end: float
    steps: tuple[int, ...] = ()
    detail: str = ""


@dataclass
class GanttData:
    rids: list[str]  # requests shown, oldest first
    spans: list[Span]
    marks: list[tuple[str, float, str]]  # (rid, time, "first_token" | "finished" | "aborted" | "retracted")
    ttft: dict[str, list[str]] = field(default_factory=dict)  # rid -> its TTFT in parts, one line each


def _step_index(state: TraceState, rids: set[str]) -> dict[tuple[int, str], StepView]:
    idx: dict[tuple[int, str], StepView] = {}
    for sv in state.steps:
        for sr in sv.reqs:
            if sr.rid in rids:
                idx[(sv.step, sr.rid)] = sv
    return idx


def gantt_data(state: TraceState, t0: int, max_requests: int = 40) -> GanttData:
    """Spans per request, one per entry of the request's TraceState timeline.

    Each prefill timeline entry (one per chunk) becomes a "prefill" span and each
    decode run a "decode" span covering its steps; the span's times come from
    the steps' own start/end when the step ring still holds them (else the
    timeline's timestamps). The "queued" span runs from arrival to the first
    prefill (or to now while the request still waits).
    """
    reqs = sorted(
        state.requests.values(), key=lambda r: (r.arrival_ts if r.arrival_ts is not None else (r.queued_ts or 0), r.rid)
    )
    reqs = reqs[-max_requests:] if max_requests else reqs
    idx = _step_index(state, {r.rid for r in reqs})
    steps = T.StepIndex(state)
    spans: list[Span] = []
    marks: list[tuple[str, float, str]] = []
    ttft: dict[str, list[str]] = {}
    for r in reqs:
        b = state.ttft_parts(r.rid, steps)
        if b is not None:
            ttft[r.rid] = ttft_lines(b)
        own: list[Span] = []
        for e in r.timeline:
            if e.kind == "prefill":
                sv = idx.get((e.step, r.rid))
                s, t = (step_start(sv), sv.ts) if sv is not None else (e.ts, e.ts)
                own.append(Span(r.rid, "prefill", _sec(s, t0), _sec(t, t0), (e.step,), e.detail))
            elif e.kind == "decode":
                first = e.step - e.count + 1
                sv0, sv1 = idx.get((first, r.rid)), idx.get((e.step, r.rid))
                s = step_start(sv0) if sv0 is not None else e.ts
                t = sv1.ts if sv1 is not None else e.end_ts
                own.append(Span(r.rid, "decode", _sec(s, t0), _sec(t, t0), tuple(range(first, e.step + 1)), e.detail))
            elif e.kind in ("first_token", "finished", "aborted", "retracted"):
                marks.append((r.rid, _sec(e.ts, t0), e.kind))
        q0 = r.arrival_ts if r.arrival_ts is not None else r.queued_ts
        if q0 is not None:
            if own:
                q1 = min(sp.start for sp in own)
            elif r.finish_ts is not None:
                q1 = _sec(r.finish_ts, t0)
            else:
                q1 = _sec(state.last_ts, t0)  # still waiting: the bar grows
            # The bar runs from arrival to the first chunk: the TTFT parts before the prefill say why.
            waited = (
                [ln for ln, p in zip(ttft[r.rid][1:], b.parts) if p.kind in ("arrived", "queued")]
                if b is not None
                else []
            )
            spans.append(
                Span(
                    r.rid,
                    "queued",
                    _sec(q0, t0),
                    max(q1, _sec(q0, t0)),
                    (),
                    "\n".join(waited) or f"queued {max(q1 - _sec(q0, t0), 0.0) * 1e3:.1f} ms",
                )
            )
        spans.extend(own)
    return GanttData([r.rid for r in reqs], spans, marks, ttft)


def ttft_lines(b: T.TtftBreakdown) -> list[str]:
    """A TTFT breakdown as text lines: the sum first, then one line per part (duration, what, why)."""
    return [b.summary()] + [f"{T.fmt_dur(p.ns)} {p.label}" + (f": {p.detail}" if p.detail else "") for p in b.parts]


def request_details(state: TraceState, rid: str) -> dict:
    """A request's facts and timeline as plain values (what a click on the Gantt shows)."""
    r = state.requests.get(rid)
    if r is None:
        return {}
    return {
        "rid": r.rid,
        "state": r.state,
        "prompt": r.prompt_preview,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "computed_tokens": r.computed_tokens,
        "output_tokens": r.output_tokens,
        "max_new_tokens": r.max_new_tokens,
        "finish_reason": r.finish_reason,
        "ttft": r.ttft,
        "tpot": r.tpot,
        "e2e": r.e2e,
        "retractions": r.retractions,
        "constraint": r.constraint,
        "priority": r.priority,  # priority scheduling (None: off)
        "preempted": r.preempted,  # its last preemption, with the reason ("" none)
        "text": r.text,
        "timeline": [(e.ts, e.kind, e.detail) for e in r.timeline],
        "ttft_parts": ttft_lines(b) if (b := state.ttft_parts(rid)) is not None else [],
        "pd": pd_details(state, rid),
    }


def pd_details(state: TraceState, rid: str) -> dict:
    """Disaggregated serving: the request's role, its peer on the other server (joined by bootstrap
    room) and its journey in one line; {} for a request of one server."""
    from workbench.core.trace.pd import journey_line

    pd = getattr(state, "pd", None)
    role = pd.role(rid) if pd else None
    if role is None:
        return {}
    room = pd.room_of(rid)
    return {"role": role, "room": room.room, "peer": pd.peer(rid), "journey": journey_line(state, rid)}


# ---- batch composition ------------------------------------------------------------


@dataclass
class BatchData:
    steps: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # prefix tokens reused (first chunks)
    computed: list[int] = field(default_factory=list)  # prompt tokens computed
    decode: list[int] = field(default_factory=list)  # decode tokens
    step_ms: list[float] = field(default_factory=list)  # schedule + forward
    batch_size: list[int] = field(default_factory=list)
    padded_size: list[int] = field(default_factory=list)
    mode: list[str] = field(default_factory=list)
    cuda_graph: list[bool] = field(default_factory=list)
    backend: list[str] = field(default_factory=list)  # attention backend of each step


def batch_data(state: TraceState, max_steps: int = 200) -> BatchData:
    """Per scheduler step: the token split (cached / computed prefill / decode) and step time."""
    steps = list(state.steps)[-max_steps:] if max_steps else list(state.steps)
    d = BatchData()
    for sv in steps:
        d.steps.append(sv.step)
        d.cached.append(sv.cached_tokens)
        d.computed.append(sv.prefill_tokens)
        d.decode.append(sv.decode_tokens)
        d.step_ms.append(sv.schedule_ms + sv.forward_ms)
        d.batch_size.append(sv.batch_size)
        d.padded_size.append(sv.padded_size)
        d.mode.append(sv.mode)
        d.cuda_graph.append(sv.cuda_graph)
        d.backend.append(sv.backend)
    return d


# ---- radix tree ------------------------------------------------------------------


@dataclass
class TreeData:
    """Icicle/treemap input: parallel lists, parent "" for the root."""

    ids: list[str] = field(default_factory=list)
    parents: list[str] = field(default_factory=list)
    values: list[int] = field(default_factory=list)  # tokens on the node's own edge
    labels: list[str] = field(default_factory=list)
    states: list[str] = field(default_factory=list)  # one of NODE_STATES (or "root")
    texts: list[str] = field(default_factory=list)
    lock_refs: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)


ROOT_ID = "root"


def node_state(n) -> str:
    if n.just_evicted:
        return "evicted"
    if n.lock_ref > 0:
        return "locked"
    if n.just_inserted:
        return "new"
    if n.hits > 0:
        return "hit"
    return "cached"


def tree_data(state: TraceState, max_label: int = 18) -> TreeData:
    """The radix tree as ids/parents/values. A node whose parent is not known (an
    insert seen before the first tree snapshot) hangs off the root, so plotly
    always gets exactly one root. Nodes evicted a few steps ago are there as ghosts (state "evicted")."""
    tree = state.display_tree()
    d = TreeData()
    roots = [n for n in tree.values() if n.parent_id == -1]
    root = min(roots, key=lambda n: n.node_id) if roots else None
    root_id = str(root.node_id) if root is not None else ROOT_ID
    d.ids.append(root_id)
    d.parents.append("")
    d.values.append(root.tokens if root is not None else 0)
    d.labels.append("root")
    d.states.append("root")
    d.texts.append("")
    d.lock_refs.append(root.lock_ref if root is not None else 0)
    d.hits.append(root.hits if root is not None else 0)
    for nid in sorted(tree):
        n = tree[nid]
        if n is root:
            continue
        parent = str(n.parent_id) if n.parent_id in tree and n.parent_id != nid else root_id
        text = n.text.replace("\n", "⏎")
        d.ids.append(str(nid))
        d.parents.append(parent)
        d.values.append(n.tokens)
        d.labels.append((text[:max_label] + "…" if len(text) > max_label else text) or f"#{nid}")
        d.states.append(node_state(n))
        d.texts.append(text)
        d.lock_refs.append(n.lock_ref)
        d.hits.append(n.hits)
    return d


# ---- KV pool and queues over time -----------------------------------------------------


@dataclass
class KVData:
    t: list[float] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    evictable: list[int] = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    total: list[int] = field(default_factory=list)


def kv_data(state: TraceState, t0: int) -> KVData:
    """The KV pool's used / evictable / free / total tokens at each kv.usage, times relative to t0."""
    d = KVData()
    for p in state.kv_history:
        d.t.append(_sec(p.ts, t0))
        d.used.append(p.used)
        d.evictable.append(p.evictable)
        d.free.append(p.free)
        d.total.append(p.total)
    return d


def kv_axis_range(k: KVData) -> tuple[int, int]:
    """The KV chart's y range: the whole pool (its largest capacity seen), so 126 used of 4096
    looks like 3 %, not like a full pool; (0, 1) before any kv.usage."""
    return 0, max(k.total, default=0) or max(
        (u + e + f for u, e, f in zip(k.used, k.evictable, k.free)), default=0
    ) or 1


@dataclass
class QueueData:
    t: list[float] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)  # queued for prefill, listed by a scheduler or not yet
    running: list[int] = field(default_factory=list)
    new: list[int] = field(default_factory=list)  # arrived at the tokenizer, not yet queued


def queue_data(state: TraceState, t0: int) -> QueueData:
    """Queue lengths over time, as TraceState sampled them (each queue.state, each arrival and
    each request queued: see TraceState.queue_history)."""
    d = QueueData()
    for p in state.queue_history:
        d.t.append(_sec(p.ts, t0))
        d.waiting.append(p.waiting)
        d.running.append(p.running)
        d.new.append(p.new)
    return d


# ---- latency ------------------------------------------------------------------------


@dataclass
class LatencyData:
    ecdf: dict[str, tuple[list[float], list[float]]]  # metric -> (sorted values s, cumulative fraction)
    arrival: list[float]  # s since t0
    ttft: list[float]
    rids: list[str]


def ecdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def latency_data(state: TraceState, t0: int) -> LatencyData:
    """TTFT/TPOT/E2E of finished (not aborted) requests, as TraceState's latency
    percentiles count them: TPOT only where more than one token came out."""
    done = [r for r in state.requests.values() if r.state == "finished"]
    ttft = [r.ttft for r in done if r.ttft is not None]
    tpot = [r.tpot for r in done if r.tpot is not None and r.output_tokens > 1]
    e2e = [r.e2e for r in done if r.e2e is not None]
    pts = sorted(
        (r.arrival_ts, r.ttft, r.rid)
        for r in state.requests.values()
        if r.arrival_ts is not None and r.ttft is not None
    )
    return LatencyData(
        {"ttft": ecdf(ttft), "tpot": ecdf(tpot), "e2e": ecdf(e2e)},
        [_sec(a, t0) for a, _, _ in pts],
        [t for _, t, _ in pts],
        [rid for _, _, rid in pts],
    )


# ---- the header line -------------------------------------------------------------------


def summary(state: TraceState) -> dict:
    """Headline numbers for the dashboard's header."""
    states: dict[str, int] = {}
    for r in state.requests.values():
        states[r.state] = states.get(r.state, 0) + 1
    tp = state.throughput()
    kv = state.kv
    last_step = state.steps[-1].step if state.steps else None
    q = state.queue_counts()
    return {
        "model": state.model,
        "step": last_step,
        "waiting": q["waiting"],
        "new": q["new"],
        "running": q["running"],
        "finished": states.get("finished", 0),
        "aborted": states.get("aborted", 0),
        "requests": len(state.requests),
        "cache_hit_rate": state.cache_hit_rate,
        "prefill_tps": tp.prefill_tps,
        "decode_tps": tp.decode_tps,
        "kv_used": kv.used if kv else 0,
        "kv_total": kv.total if kv else 0,
        "kv_evictable": state.evictable if kv else 0,
        "dropped": state.counters.dropped_events,
    }


# ---- experts (mixture-of-experts models) ------------------------------------------------------
EXPERT_MAPS = ("all steps", "last step")  # then one entry per request seen routing


@dataclass
class ExpertData:
    z: list[list[int]]  # [layer][expert] tokens
    layers: list[str]  # y labels, "L<id>"
    experts: list[int]  # x
    title: str
    rids: list[str]  # requests with routing, most recent first (the selector's choices)


def expert_data(state: TraceState, which: str = "all steps", max_rids: int = 50) -> ExpertData:
    """The heatmap of `which`: every step so far, the last step, or one request's tokens."""
    load = state.experts
    rids = list(reversed(load.requests()))[:max_rids]
    if not load.present:
        return ExpertData([], [], [], "Experts: no moe.routing event yet (a dense model has none)", rids)
    if which == "last step":
        z, what = load.last, f"step {load.last_step}"
    elif which in EXPERT_MAPS or load.request(which) is None:
        z, what = load.total, f"all {load.steps} steps"
    else:
        z, what = load.request(which), f"request {short_rid(which)}"
    worst = max((imbalance(row) for row in z), default=0.0)
    title = f"Tokens per expert, {what}: {load.num_experts} experts, top {load.top_k}; worst imbalance {worst:.1f}×"
    return ExpertData([list(r) for r in z], [f"L{i}" for i in load.layers], list(range(load.num_experts)), title, rids)
