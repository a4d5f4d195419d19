"""TraceState: the one reducer that folds trace events into the current picture.

Every view (TUI panels, Jupyter widgets, replay, tests) reads only this
object; it is pure and deterministic: `apply(event)` never looks at a clock,
so the same events give the same state, whether they came live from the bus,
from a recording or from a replay. Anything time-dependent (latency
percentiles over the last N seconds, rolling throughput) takes `now_ns` from
the caller.

Events from different processes can arrive out of order (the tokenizer's
`req.finished` may overtake the scheduler's last `batch.step`); the reducer
orders request state changes by event timestamp, treats finished/aborted as
final, and creates unknown requests lazily. Memory is bounded: rings for
steps and histories, a cap on finished requests (oldest dropped first) and on
all requests.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from workbench.core.trace import events as ev
from workbench.core.trace.experts import ExpertLoad
from workbench.core.trace.narration import (  # noqa: F401  (re-exported)
    WAIT_REASONS,
    describe_step,
    narrate_spec,
    narrate_step,
)
from workbench.core.trace.pd import PDJoin, pd_ttft_breakdown, transfer_detail
from workbench.core.trace.speculative import SpecStats
from workbench.core.trace.ttft import StepIndex, TtftBreakdown, ttft_breakdown
from workbench.core.trace.views import (  # noqa: F401  (re-exported for views)
    LATENCY_METRICS,
    REQ_STATES,
    REQUEST_SNAPSHOT_FIELDS,
    TERMINAL_STATES,
    Counters,
    KVPoint,
    ProcView,
    QueuePoint,
    ReplicaView,
    RequestView,
    StepView,
    Throughput,
    TimelineEntry,
    TreeNodeView,
    percentile,
)

# Names the trace machinery itself stamps on events it makes (drop markers,
# headers, replay resets): not engine processes, so not listed in `procs`.
_PSEUDO_PROCS = frozenset({"bus", "recorder", "replay"})
# Data-parallel scheduler replicas trace as "scheduler.dp0", "scheduler.dp1", ...
_REPLICA_PREFIX = "scheduler.dp"
#: How long an evicted radix node stays on show as a ghost (display_tree): this many scheduler
#: steps, and at least this much trace time, so a fast scheduler's eviction is still seen.
GHOST_STEPS = 8
GHOST_NS = 3_000_000_000
_MAX_GHOSTS = 256  # per scheduler: a burst of evictions must not grow the picture without end


def _is_replica(proc: str) -> bool:
    return proc.startswith(_REPLICA_PREFIX) and proc[len(_REPLICA_PREFIX) :].isdigit()


@dataclass
class _Book:
    """Reducer bookkeeping per request, kept out of the public view."""

    state_ts: int = -1
    round: int = 0  # bumps on retraction (re-prefill)
    base_computed: int = 0  # from a snapshot
    base_recomputed: int = 0  # from a snapshot
    chunks: dict = field(default_factory=dict)  # (round, chunk) -> computed tokens
    tl_chunks: set = field(default_factory=set)  # (round, chunk) already on the timeline
    tl_prefill: dict = field(default_factory=dict)  # (round, chunk) -> its timeline entry (relabelled
    # when a later chunk changes the count n)
    sampled_rounds: set = field(default_factory=set)
    final: bool = False  # counts came from req.finished
    counted_finish: bool = False
    counted_abort: bool = False
    in_finished: bool = False


class TraceState:
    """Folds trace events into the current picture; see the module docstring.

    Public, read-only for views: requests, waiting, running, chunked, held (+ held_reason), steps
    (each with its batch.decision; narrate(), last_step_line and step_rids() tell a step in words),
    kv, kv_by_proc, kv_history, queue_history, tree (+ trees per scheduler),
    tree_evictable_size, tree_protected_size, evictable (the one figure views show), unlisted() and
    queue_counts() (requests not listed by a scheduler yet), counters, cache_hit_rate,
    throughput(), latency_percentiles(), last_ts, weights_version, model, procs,
    req_replica and replicas() (data parallel: which replica holds each request), ttft_parts(rid)
    (where a request's time to first token went, in parts that sum to it), experts (a mixture of
    experts' load per layer and expert, and per request: core/trace/experts.py).
    """

    def __init__(
        self,
        *,
        max_steps: int = 2000,
        max_history: int = 2000,
        max_finished: int = 5000,
        max_requests: int = 20000,
        max_latency_samples: int = 20000,
        max_steps_per_request: int = 4096,
        max_timeline: int = 512,
    ):
        self._caps = dict(
            max_steps=max_steps,
            max_history=max_history,
            max_finished=max_finished,
            max_requests=max_requests,
            max_latency_samples=max_latency_samples,
            max_steps_per_request=max_steps_per_request,
            max_timeline=max_timeline,
        )
        self.max_finished = max_finished
        self.max_requests = max_requests
        self.max_steps_per_request = max_steps_per_request
        self.max_timeline = max_timeline
        self.requests: dict[str, RequestView] = {}
        self.loras_seen = False  # a request ran under a LoRA adapter (the Batch panel then colours by adapter)
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.chunked: list[str] = []
        self.held: list[ev.HeldReq] = []  # waiting requests held back (in-batch prefix caching)
        self.steps: deque[StepView] = deque(maxlen=max_steps)
        self.kv: ev.KVUsage | None = None
        self.kv_by_proc: dict[str, ev.KVUsage] = {}
        self.kv_history: deque[KVPoint] = deque(maxlen=max_history)
        self.queue_history: deque[QueuePoint] = deque(maxlen=max_history)
        self.trees: dict[str, dict[int, TreeNodeView]] = {}
        # Evicted nodes kept on show after the snapshot that dropped them: proc -> node id -> its
        # last view (evicted_step set). Never part of `trees` (the digests compare those).
        self.ghosts: dict[str, dict[int, TreeNodeView]] = {}
        self.tree_proc: str | None = None
        self.tree_evictable_size = 0
        self.tree_protected_size = 0
        self.counters = Counters()
        self.last_ts = 0
        self.weights_version = 0
        self.weights_source = ""
        self.model = ""
        self.schema_version = ev.SCHEMA_VERSION
        self.procs: dict[str, ProcView] = {}
        self.req_replica: dict[str, str] = {}  # rid -> "scheduler.dp<rank>" (data parallel)
        self._books: dict[str, _Book] = {}
        self._finished_order: dict[str, None] = {}  # insertion-ordered set
        self._queues: dict[str, ev.QueueState] = {}
        self._latency: deque[tuple[int, float, float | None, float]] = deque(maxlen=max_latency_samples)
        self._first_step_start: int | None = None
        # batch.decision events whose batch.step has not come yet (overlap loop), by (proc, step).
        self._pending_decisions: dict[tuple[str, int], ev.StepDecision] = {}
        self._last_decision: dict[str, ev.StepDecision] = {}  # per scheduler, its latest
        self.experts = ExpertLoad()  # mixture-of-experts models: tokens per expert (moe.routing)
        self.spec = SpecStats()  # speculative decoding: drafts proposed and accepted (spec.verify)
        self.pd = PDJoin()  # disaggregated serving: both servers' requests joined by bootstrap room
        # Each handler takes the event type it is filed under.
        self._dispatch: dict[type[ev.Event], Callable[[Any], None]] = {
            ev.ReqArrived: self._on_arrived,
            ev.ReqTokenized: self._on_tokenized,
            ev.ReqQueued: self._on_queued,
            ev.ReqScheduled: self._on_scheduled,
            ev.ReqDispatched: self._on_dispatched,
            ev.ReqFirstToken: self._on_first_token,
            ev.ReqFinished: self._on_finished,
            ev.ReqAborted: self._on_aborted,
            ev.ReqRetracted: self._on_retracted,
            ev.ReqText: self._on_text,
            ev.BatchStep: self._on_step,
            ev.StepDecision: self._on_decision,
            ev.MoeRouting: self.experts.apply,
            ev.SpecVerify: self._on_spec,
            ev.PDBootstrap: self._on_pd,
            ev.PDReserved: self._on_pd,
            ev.PDTransfer: self._on_pd,
            ev.QueueState: self._on_queue,
            ev.KVUsage: self._on_kv,
            ev.CacheMatch: self._on_match,
            ev.CacheInsert: self._on_insert,
            ev.CacheEvict: self._on_evict,
            ev.CacheTree: self._on_tree,
            ev.WeightsUpdated: self._on_weights,
            ev.ProcStarted: self._on_proc_started,
            ev.ProcExited: self._on_proc_exited,
            ev.TraceDropped: self._on_dropped,
            ev.TraceHeader: self._on_header,
            ev.ReqSnapshot: self._on_req_snapshot,
            ev.TraceCounters: self._on_counters,
        }

    # ---- public read helpers ------------------------------------------------

    @property
    def tree(self) -> dict[int, TreeNodeView]:
        """The radix tree of the (first) scheduler that reported one."""
        return self.trees.get(self.tree_proc, {}) if self.tree_proc is not None else {}

    def display_tree(self, proc: str | None = None) -> dict[int, TreeNodeView]:
        """The radix tree (of `proc`, default the first scheduler's) plus its ghosts: nodes evicted
        in the last GHOST_STEPS steps (or GHOST_NS of trace time), marked `just_evicted` with their
        `evicted_step`, hung under their parent (or the root when it went too), so a view shows
        what an eviction took. `trees` stays the cache as it is; this is for drawing only."""
        proc = self.tree_proc if proc is None else proc
        tree = self.trees.get(proc, {}) if proc is not None else {}
        ghosts = [g for nid, g in self.ghosts.get(proc or "", {}).items() if nid not in tree and self._ghost_alive(g)]
        if not ghosts:
            return tree
        out = dict(tree)
        roots = [n.node_id for n in tree.values() if n.parent_id == -1]
        for g in sorted(ghosts, key=lambda g: g.node_id):
            out[g.node_id] = replace(g, children=[])
        for g in sorted(ghosts, key=lambda g: g.node_id):
            parent_id = g.parent_id if g.parent_id in out else (min(roots) if roots else g.parent_id)
            out[g.node_id].parent_id = parent_id
            parent = out.get(parent_id)
            if parent is not None:
                if parent_id in tree:  # a live node: draw a copy, never touch the cache's own view
                    parent = out[parent_id] = replace(parent, children=list(parent.children))
                parent.children.append(g.node_id)
        return out

    def _ghost_alive(self, g: TreeNodeView) -> bool:
        step = self.steps[-1].step if self.steps else g.evicted_step
        return step - g.evicted_step <= GHOST_STEPS or self.last_ts - g.last_access <= GHOST_NS

    @property
    def last_step_line(self) -> str:
        """The last scheduler step in one line of plain language ("" before any step); see narrate."""
        return self.narrate(self.steps[-1]) if self.steps else ""

    def narrate(self, sv: StepView) -> str:
        """One step as a sentence: what ran (admitted, chunks, cached + computed tokens, the token
        budget, running requests that waited) and, when its `batch.decision` is known, KV slots
        allocated/freed, evictions, retractions and why the others still wait. Older recordings
        (no batch.decision) get the part the batch.step alone tells."""
        return narrate_step(sv)

    def describe(self, sv: StepView) -> list[tuple[str, str]]:
        """A step's whole decision as (heading, text) rows (narration.describe_step), evicted
        nodes named by their text where the tree or its ghosts still know it."""
        texts = {nid: n.text for nid, n in self.ghosts.get(sv.proc, {}).items() if n.text}
        texts.update({nid: n.text for nid, n in self.trees.get(sv.proc, {}).items() if n.text})
        return describe_step(sv, texts)

    def step_rids(self, sv: StepView | None = None) -> set[str]:
        """The requests a step (default: the last) touched beyond decoding one token: those it
        prefilled (admitted, or a chunk continued) and those it retracted."""
        if sv is None:
            if not self.steps:
                return set()
            sv = self.steps[-1]
        out = {r.rid for r in sv.reqs if r.computed > 0}
        if sv.decision is not None:
            out.update(sv.decision.retracted)
        return out

    def wait_reason(self, rid: str) -> str | None:
        """Why a waiting request was not admitted by the last step that could have admitted it
        (a WAIT_REASONS key, or "held" for in-batch prefix caching); None if it was not turned
        away (it came after that step, or no batch.decision is known)."""
        r = self.requests.get(rid)
        if r is None or r.state not in ("queued", "retracted"):
            return None
        for d in self._last_decision.values():
            if r.queued_ts is not None and r.queued_ts > d.ts:
                continue
            if rid in d.held:
                return "held"
            if d.stop_rid and rid in self.waiting:
                return d.stop_reason
        return None

    def ttft_parts(
        self, rid: str, index: StepIndex | None = None, now_ns: int | None = None, paused: bool = False
    ) -> TtftBreakdown | None:
        """The request's TTFT in parts that sum to it exactly: arrived → queued (and the step the
        scheduler was busy in), queued (passed over by which steps, why, and who got the prefill),
        each prefill chunk (with whom it shared the step), first token; see core/trace/ttft.py.
        The parts so far (`partial`) before the first token; None without an arrival. Pass one
        `StepIndex(state)` to explain many requests at once; `now_ns` (and `paused`, the scheduler
        is): a live view's clock, the parts so far then run to now. The decode side of a disaggregated
        request whose prefill side is in this trace too: along its journey (core/trace/pd.py)."""
        if self.pd:
            joined = pd_ttft_breakdown(self, rid, index)
            if joined is not None:
                return joined
        return ttft_breakdown(self, rid, index, now_ns, paused)

    def held_reason(self, rid: str) -> str | None:
        """Why a waiting request was held back in the last step, or None if it was not."""
        return next((h.reason() for h in self.held if h.rid == rid), None)

    @property
    def queues_by_proc(self) -> dict[str, ev.QueueState]:
        """The latest queue.state of each scheduler (one per data-parallel replica)."""
        return dict(self._queues)

    def replicas(self) -> list[ReplicaView]:
        """Data-parallel replicas in rank order (empty without data parallelism)."""
        names = {p for p in (*self._queues, *self.kv_by_proc, *self.req_replica.values()) if _is_replica(p)}
        names.update(s.proc for s in self.steps if _is_replica(s.proc))
        per_req: dict[str, int] = {}
        for p in self.req_replica.values():
            per_req[p] = per_req.get(p, 0) + 1
        out = []
        for p in sorted(names, key=lambda n: int(n[len(_REPLICA_PREFIX) :])):
            q = self._queues.get(p)
            out.append(
                ReplicaView(
                    p,
                    int(p[len(_REPLICA_PREFIX) :]),
                    list(q.waiting) if q else [],
                    list(q.running) if q else [],
                    self.kv_by_proc.get(p),
                    per_req.get(p, 0),
                    sum(1 for s in self.steps if s.proc == p),
                )
            )
        return out

    @property
    def cache_hit_rate(self) -> float:
        """Share of prefilled prompt tokens served from the radix cache, counted as requests are
        admitted (each batch.step: a request's cached prefix at its first chunk, every computed
        chunk), so it moves while requests run; before any step, over finished requests."""
        c = self.counters
        pre = c.prefill_cached_total + c.prefill_computed_total
        if pre:
            return c.prefill_cached_total / pre
        return c.cached_tokens_total / c.prompt_tokens_total if c.prompt_tokens_total else 0.0

    @property
    def evictable(self) -> int:
        """Evictable tokens (cached, locked by no request): the ONE figure every view shows (the
        KV pool and the radix tree's title alike). It comes from kv.usage, sent every step, of the
        scheduler whose tree is shown (all schedulers summed when no tree is known yet); before
        any kv.usage, from the last cache.tree."""
        k = self.kv_by_proc.get(self.tree_proc) if self.tree_proc is not None else None
        if k is None:
            k = self.kv
        return k.evictable if k is not None else self.tree_evictable_size

    def unlisted(self) -> list[RequestView]:
        """Requests no scheduler lists yet, in arrival order: state "queued" (the scheduler took
        them in, its next queue.state will list them; while paused that is the next step) or
        "arrived" (`new`: the tokenizer has them, the scheduler not yet)."""
        listed = set(self.waiting)
        listed.update(self.running)
        listed.update(self.chunked)
        return [r for r in self.requests.values() if r.state in ("arrived", "queued") and r.rid not in listed]

    def queue_counts(self) -> dict[str, int]:
        """waiting (listed by a scheduler or queued but not listed yet), new (arrived, not queued),
        running, chunked: the counts every header shows."""
        extra = self.unlisted()
        new = sum(1 for r in extra if r.state == "arrived")
        return {
            "waiting": len(self.waiting) + len(extra) - new,
            "new": new,
            "running": len(self.running),
            "chunked": len(self.chunked),
        }

    def throughput(self, window_s: float = 5.0, now_ns: int | None = None) -> Throughput:
        """Prefill and decode tokens/s over steps in (now - window, now].

        now_ns defaults to the last event's ts (so an idle engine keeps its last
        figure); pass the current monotonic time to see it decay.
        """
        now = self.last_ts if now_ns is None else now_ns
        start = now - int(window_s * 1e9)
        if self._first_step_start is not None:
            start = max(start, self._first_step_start)
        span = (now - start) / 1e9
        if span <= 0:
            return Throughput(0.0, 0.0)
        pre = dec = 0
        for s in reversed(self.steps):
            if s.ts <= start:
                break
            if s.ts <= now:
                pre += s.prefill_tokens
                dec += s.decode_tokens
        return Throughput(pre / span, dec / span)

    def latency_percentiles(self, window_s: float, now_ns: int) -> dict[str, tuple[float, float, float] | None]:
        """(p50, p90, p99) of ttft/tpot/e2e for requests finished in (now - window, now];
        None for a metric with no samples. Aborted requests are left out, and so is
        tpot of single-token outputs."""
        lo = now_ns - int(window_s * 1e9)
        cols: dict[str, list[float]] = {m: [] for m in LATENCY_METRICS}
        for ts, ttft, tpot, e2e in self._latency:
            if lo < ts <= now_ns:
                cols["ttft"].append(ttft)
                if tpot is not None:
                    cols["tpot"].append(tpot)
                cols["e2e"].append(e2e)
        out: dict[str, tuple[float, float, float] | None] = {}
        for m, vals in cols.items():
            vals.sort()
            out[m] = (percentile(vals, 50), percentile(vals, 90), percentile(vals, 99)) if vals else None
        return out

    def dump(self) -> dict:
        """Canonical, JSON-able dump of the whole public state (for tests and debugging)."""
        return msgspec.to_builtins(
            {
                "requests": {k: self.requests[k] for k in sorted(self.requests)},
                "waiting": self.waiting,
                "running": self.running,
                "chunked": self.chunked,
                "held": self.held,
                "steps": list(self.steps),
                "kv": self.kv,
                "kv_by_proc": self.kv_by_proc,
                "kv_history": list(self.kv_history),
                "queue_history": list(self.queue_history),
                "trees": {p: {str(k): t[k] for k in sorted(t)} for p, t in sorted(self.trees.items())},
                "tree_proc": self.tree_proc,
                "tree_evictable_size": self.tree_evictable_size,
                "tree_protected_size": self.tree_protected_size,
                "counters": self.counters,
                "last_ts": self.last_ts,
                "weights_version": self.weights_version,
                "model": self.model,
                "procs": {k: self.procs[k] for k in sorted(self.procs)},
                "req_replica": {k: self.req_replica[k] for k in sorted(self.req_replica)},
            }
        )

    # ---- folding --------------------------------------------------------------

    def apply_many(self, events) -> None:
        for e in events:
            self.apply(e)

    def apply(self, event: ev.Event) -> None:
        """Fold one event into the state."""
        if type(event) is ev.TraceReset:
            TraceState.__init__(self, **self._caps)
            return
        if type(event) is ev.TraceHeader:  # metadata: its ts is when recording began
            self._on_header(event)
            return
        if event.ts > self.last_ts:
            self.last_ts = event.ts
        if event.proc and event.proc not in _PSEUDO_PROCS:
            p = self.procs.get(event.proc)
            if p is None:
                p = self.procs[event.proc] = ProcView(event.proc)
            p.events += 1
            if event.ts > p.last_ts:
                p.last_ts = event.ts
        handler = self._dispatch.get(type(event))
        if handler is not None:
            handler(event)

    # ---- requests -------------------------------------------------------------

    def _req(self, rid: str) -> tuple[RequestView, _Book]:
        r = self.requests.get(rid)
        if r is None:
            r = self.requests[rid] = RequestView(rid)
            self._books[rid] = _Book()
            if len(self.requests) > self.max_requests:
                self._forget(next(iter(self.requests)))
        return r, self._books[rid]

    def _forget(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self._books.pop(rid, None)
        self._finished_order.pop(rid, None)
        self.req_replica.pop(rid, None)

    def _set_state(self, r: RequestView, b: _Book, state: str, ts: int) -> None:
        # Terminal states are final; otherwise the latest event (by ts) wins, so a
        # late req.arrived from the tokenizer cannot undo the scheduler's req.queued.
        if r.state in TERMINAL_STATES:
            return
        if state in TERMINAL_STATES or ts >= b.state_ts:
            r.state, b.state_ts = state, ts

    def _timeline(self, r: RequestView, entry: TimelineEntry) -> None:
        tl = r.timeline
        if len(tl) >= self.max_timeline and entry.kind not in TERMINAL_STATES:
            return
        if not tl or entry.ts >= tl[-1].ts:
            tl.append(entry)
        else:
            bisect.insort(tl, entry, key=lambda e: e.ts)

    def _decode_timeline(self, r: RequestView, ts: int, step: int) -> None:
        # Consecutive decode steps fold into one run; a gap in step ids (the request
        # sat out a step, e.g. behind a chunked prefill) starts a new run.
        tl = r.timeline
        i = bisect.bisect_right(tl, ts, key=lambda t: t.ts)
        prev = tl[i - 1] if i else None
        if prev is not None and prev.kind == "decode" and prev.step == step - 1 and ts >= prev.end_ts:
            prev.end_ts, prev.step = ts, step
            prev.count += 1
            prev.detail = f"{prev.count} steps"
        else:
            self._timeline(r, TimelineEntry(ts, "decode", "1 step", end_ts=ts, step=step))

    def _add_step(self, r: RequestView, step: int) -> None:
        r.steps.append(step)
        if len(r.steps) > self.max_steps_per_request:
            del r.steps[0]

    def _mark_finished(self, rid: str, b: _Book) -> None:
        if b.in_finished:
            return
        b.in_finished = True
        self._finished_order[rid] = None
        while len(self._finished_order) > self.max_finished:
            self._forget(next(iter(self._finished_order)))

    def _on_arrived(self, e: ev.ReqArrived) -> None:
        before = self._queue_slot(e.rid)
        r, b = self._req(e.rid)
        r.arrival_ts = e.ts
        if e.prompt_preview:
            r.prompt_preview = e.prompt_preview
        self._set_state(r, b, "arrived", e.ts)
        self._timeline(r, TimelineEntry(e.ts, "arrived"))
        self._nudge_queues(e.rid, before, e.ts)

    def _on_tokenized(self, e: ev.ReqTokenized) -> None:
        r, _ = self._req(e.rid)
        if not self._books[e.rid].final:
            r.prompt_tokens = e.prompt_tokens
        r.max_new_tokens = e.max_new_tokens

    def _note_replica(self, rid: str, proc: str) -> None:
        if _is_replica(proc):
            self.req_replica[rid] = proc

    def _on_dispatched(self, e: ev.ReqDispatched) -> None:
        r, _ = self._req(e.rid)
        self.req_replica[e.rid] = f"{_REPLICA_PREFIX}{e.dp_rank}"
        hint = f", ~{e.matched_tokens} cached" if e.matched_tokens else ""
        detail = f"to dp{e.dp_rank} ({e.method}{hint})"
        self._timeline(r, TimelineEntry(e.ts, "dispatched", detail))

    def _on_queued(self, e: ev.ReqQueued) -> None:
        before = self._queue_slot(e.rid)
        r, b = self._req(e.rid)
        self._note_replica(e.rid, e.proc)
        if r.queued_ts is None:
            r.queued_ts = e.ts
        if e.constraint:
            r.constraint = e.constraint
        if e.priority is not None:
            r.priority = e.priority
        if e.lora:
            r.lora = e.lora
            self.loras_seen = True
        if not b.final and e.prompt_tokens:
            r.prompt_tokens = e.prompt_tokens
        self._set_state(r, b, "queued", e.ts)
        detail = f"queue length {e.queue_len}" + (f", constrained by {e.constraint}" if e.constraint else "")
        self._timeline(r, TimelineEntry(e.ts, "queued", detail, step=e.step))
        self._nudge_queues(e.rid, before, e.ts)

    def _record_chunk(
        self, r: RequestView, b: _Book, ts: int, step: int, chunk: int, n: int, cached: int, computed: int
    ) -> None:
        key = (b.round, chunk)
        b.chunks[key] = computed
        # req.finished carries no computed count, so chunks keep counting after it. The first
        # prefill's chunks are the prompt's computed part (cached + computed = prompt); a prefill
        # after a retraction (prompt and output so far again) is recomputed, counted apart.
        r.computed_tokens = b.base_computed + sum(v for (rd, _), v in b.chunks.items() if rd == 0)
        r.recomputed_tokens = b.base_recomputed + sum(v for (rd, _), v in b.chunks.items() if rd > 0)
        if chunk == 0 and b.round == 0 and not b.final:
            r.cached_tokens = cached
        if ts >= b.state_ts:
            r.chunk_index, r.num_chunks = chunk, n
        if key not in b.tl_chunks:
            b.tl_chunks.add(key)
            # A later chunk's prefix is the request's own earlier chunks, not a cache hit.
            what = f"{cached} cached + {computed} computed" if chunk == 0 else f"{computed} computed"
            entry = TimelineEntry(ts, "prefill", f"chunk {chunk + 1}/{n}: {what}", step=step)
            self._timeline(r, entry)
            b.tl_prefill[key] = entry
            # n is the scheduler's estimate when it cut the chunk; a later chunk knows better, and
            # the earlier ones of this round say the same n (never `1/1` then `2/2`).
            for (rd, k), old in b.tl_prefill.items():
                if rd == b.round and k != chunk and not old.detail.startswith(f"chunk {k + 1}/{n}:"):
                    old.detail = f"chunk {k + 1}/{n}:" + old.detail.split(":", 1)[1]

    def _on_scheduled(self, e: ev.ReqScheduled) -> None:
        r, b = self._req(e.rid)
        self._note_replica(e.rid, e.proc)
        if e.extend_len == 0 and self.pd.role(e.rid) == "decode":  # PD: its KV came from the prefill server
            self._timeline(r, TimelineEntry(e.ts, "installed", "KV written into its reserved slots; joins the batch"))
            self._set_state(r, b, "prefilling", e.ts)
            return
        self._record_chunk(r, b, e.ts, e.step, e.chunk_index, e.num_chunks, e.prefix_hit, e.extend_len)
        self._set_state(r, b, "prefilling", e.ts)

    def _on_pd(self, e: ev.PDBootstrap | ev.PDReserved | ev.PDTransfer) -> None:
        """Disaggregated serving: the room joins the two servers' requests (core/trace/pd.py); the
        reservation and each side's transfer are steps on the request's timeline."""
        self.pd.apply(e)
        if not e.rid or e.rid not in self.requests:
            return
        r = self.requests[e.rid]
        if isinstance(e, ev.PDReserved):
            self._timeline(r, TimelineEntry(e.ts, "reserved", f"{e.tokens} KV slots; pulling room {e.room}"))
        elif isinstance(e, ev.PDTransfer):
            what = "sent" if e.role == "prefill" else "received"
            self._timeline(r, TimelineEntry(e.ts, "transfer", f"{what} {transfer_detail(e)}"))

    def _on_first_token(self, e: ev.ReqFirstToken) -> None:
        r, b = self._req(e.rid)
        r.first_token_ts = e.ts
        if r.ttft is None and r.arrival_ts is not None:
            r.ttft = (e.ts - r.arrival_ts) / 1e9
        self._set_state(r, b, "running", e.ts)
        self._timeline(r, TimelineEntry(e.ts, "first_token"))

    def _on_finished(self, e: ev.ReqFinished) -> None:
        r, b = self._req(e.rid)
        aborted = e.reason == "abort"
        r.finish_ts, r.finish_reason = e.ts, e.reason
        r.prompt_tokens, r.output_tokens, r.cached_tokens = e.prompt_tokens, e.completion_tokens, e.cached_tokens
        r.ttft, r.tpot, r.e2e = e.ttft, e.tpot, e.e2e
        b.final = True
        self._set_state(r, b, "aborted" if aborted else "finished", e.ts)
        if not b.counted_finish:
            b.counted_finish = True
            c = self.counters
            c.num_requests_total += 1
            c.prompt_tokens_total += e.prompt_tokens
            c.generation_tokens_total += e.completion_tokens
            c.cached_tokens_total += e.cached_tokens
            if aborted:
                self._count_abort(b)
            else:
                tpot = e.tpot if e.completion_tokens > 1 else None
                self._latency.append((e.ts, e.ttft, tpot, e.e2e))
            self._timeline(
                r,
                TimelineEntry(e.ts, "aborted" if aborted else "finished", f"{e.reason}, {e.completion_tokens} tokens"),
            )
        self._mark_finished(e.rid, b)

    def _count_abort(self, b: _Book) -> None:
        if not b.counted_abort:
            b.counted_abort = True
            self.counters.num_aborted += 1

    def _on_aborted(self, e: ev.ReqAborted) -> None:
        before = self._queue_slot(e.rid)
        r, b = self._req(e.rid)
        if r.finish_ts is None:
            r.finish_ts = e.ts
            r.finish_reason = "abort"
        self._set_state(r, b, "aborted", e.ts)
        if not b.counted_abort:
            self._timeline(r, TimelineEntry(e.ts, "aborted", e.reason))
        self._count_abort(b)
        self._mark_finished(e.rid, b)
        self._nudge_queues(e.rid, before, e.ts)

    def _on_retracted(self, e: ev.ReqRetracted) -> None:
        r, b = self._req(e.rid)
        r.retractions += 1
        self.counters.num_retracted += 1
        if not b.final:
            r.output_tokens = e.output_tokens
        b.round += 1
        self._set_state(r, b, "retracted", e.ts)
        detail = f"after {e.output_tokens} output tokens"
        if e.reason:  # a priority preemption: who it made room for
            r.preempted = e.reason
            detail = f"{e.reason}, {detail}"
        self._timeline(r, TimelineEntry(e.ts, "retracted", detail, step=e.step))

    def _on_text(self, e: ev.ReqText) -> None:
        r, _ = self._req(e.rid)
        r.text += e.delta

    # ---- steps, queues, KV ----------------------------------------------------

    def _on_step(self, e: ev.BatchStep) -> None:
        sv = StepView(
            e.step,
            e.ts,
            e.proc,
            e.mode,
            list(e.reqs),
            e.batch_size,
            e.padded_size,
            e.cuda_graph,
            e.backend,
            e.schedule_ms,
            e.forward_ms,
            decision=self._pending_decisions.pop((e.proc, e.step), None),
        )
        if self._first_step_start is None:
            self._first_step_start = e.ts - int((e.schedule_ms + e.forward_ms) * 1e6)
        c = self.counters
        for sr in e.reqs:
            r, b = self._req(sr.rid)
            self._add_step(r, e.step)
            if sr.computed > 0:
                sv.prefill_tokens += sr.computed
                c.prefill_computed_total += sr.computed
                if sr.chunk_index == 0:
                    sv.cached_tokens += sr.cached
                    c.prefill_cached_total += sr.cached
                self._record_chunk(r, b, e.ts, e.step, sr.chunk_index, sr.num_chunks, sr.cached, sr.computed)
                if sr.chunk_index >= sr.num_chunks - 1:
                    # The last chunk samples the request's first token (of this round).
                    if b.round not in b.sampled_rounds:
                        b.sampled_rounds.add(b.round)
                        if not b.final:
                            r.output_tokens += 1
                    self._set_state(r, b, "running", e.ts)
                else:
                    self._set_state(r, b, "prefilling", e.ts)
            elif sr.decode > 0:
                sv.decode_tokens += sr.decode
                c.decode_tokens_total += sr.decode
                if not b.final:
                    r.output_tokens += sr.decode
                self._set_state(r, b, "running", e.ts)
                self._decode_timeline(r, e.ts, e.step)
        self.steps.append(sv)

    def _on_spec(self, e: ev.SpecVerify) -> None:
        """Drafts kept add tokens beyond the step's one per request (its batch.step came first)."""
        self.spec.apply(e)
        if e.snapshot:
            return  # totals only: the requests' own snapshots carry their token counts
        sv = next((s for s in reversed(self.steps) if s.step == e.step and s.proc == e.proc), None)
        if sv is not None:
            sv.spec = e
        for r in e.reqs:
            if not r.accepted:
                continue
            view, b = self._req(r.rid)
            if not b.final:
                view.output_tokens += r.accepted
            self.counters.decode_tokens_total += r.accepted
            if sv is not None:
                sv.decode_tokens += r.accepted

    def _on_decision(self, e: ev.StepDecision) -> None:
        old = self._last_decision.get(e.proc)
        if old is None or old.step <= e.step:
            self._last_decision[e.proc] = e
        for sv in reversed(self.steps):
            if sv.step == e.step and sv.proc == e.proc:
                sv.decision = e
                return
            if sv.step < e.step - 4:
                break
        self._pending_decisions[(e.proc, e.step)] = e
        if len(self._pending_decisions) > 64:
            self._pending_decisions.pop(next(iter(self._pending_decisions)))

    def _on_queue(self, e: ev.QueueState) -> None:
        old = self._queues.get(e.proc)
        if old is not None and old.ts > e.ts:
            return
        self._queues[e.proc] = e
        procs = sorted(self._queues)
        self.waiting = [rid for p in procs for rid in self._queues[p].waiting]
        self.running = [rid for p in procs for rid in self._queues[p].running]
        self.chunked = [rid for p in procs for rid in self._queues[p].chunked]
        self.held = [h for p in procs for h in self._queues[p].held]
        q = self.queue_counts()
        self._push_queue_point(e.ts, q["waiting"], q["running"], q["new"])

    # The queue chart samples at every queue.state (a full count) and also when a request arrives,
    # is queued or is aborted before a scheduler lists it: between steps those are the only moves,
    # and a chart fed by queue.state alone shows waiting 0 whenever each step admits everything.
    def _queue_slot(self, rid: str) -> tuple[int, int]:
        """(waiting, new) that one request adds to queue_counts() now."""
        r = self.requests.get(rid)
        if r is None:
            return 0, 0
        if rid in self.waiting:
            return 1, 0
        if r.state not in ("arrived", "queued") or rid in self.running or rid in self.chunked:
            return 0, 0
        return (1, 0) if r.state == "queued" else (0, 1)

    def _nudge_queues(self, rid: str, before: tuple[int, int], ts: int) -> None:
        after = self._queue_slot(rid)
        if after != before:  # no recount: the last point moved by this request alone
            last = self.queue_history[-1] if self.queue_history else QueuePoint(ts, 0, 0, 0)
            self._push_queue_point(
                ts, max(last.waiting + after[0] - before[0], 0), last.running, max(last.new + after[1] - before[1], 0)
            )

    def _push_queue_point(self, ts: int, waiting: int, running: int, new: int) -> None:
        if self.queue_history:  # tokenizer and scheduler events interleave a little: x never goes back
            ts = max(ts, self.queue_history[-1].ts)
        self.queue_history.append(QueuePoint(ts, waiting, running, new))

    def _on_kv(self, e: ev.KVUsage) -> None:
        old = self.kv_by_proc.get(e.proc)
        if old is not None and old.ts > e.ts:
            return
        self.kv_by_proc[e.proc] = e
        if len(self.kv_by_proc) == 1:
            self.kv = e
        else:
            vals = list(self.kv_by_proc.values())
            self.kv = ev.KVUsage(
                ts=max(v.ts for v in vals),
                proc="",
                used=sum(v.used for v in vals),
                evictable=sum(v.evictable for v in vals),
                free=sum(v.free for v in vals),
                total=sum(v.total for v in vals),
            )
        k = self.kv
        self.kv_history.append(KVPoint(e.ts, k.used, k.evictable, k.free, k.total))

    # ---- radix cache ----------------------------------------------------------

    def _tree_for(self, proc: str) -> dict[int, TreeNodeView]:
        if self.tree_proc is None:
            self.tree_proc = proc
        return self.trees.setdefault(proc, {})

    def _on_match(self, e: ev.CacheMatch) -> None:
        r, b = self._req(e.rid)
        if not b.final and b.round == 0:  # a re-admission's match is not the prompt's cached part
            r.cached_tokens = e.matched
            if e.prompt_tokens:
                r.prompt_tokens = e.prompt_tokens

    def _on_insert(self, e: ev.CacheInsert) -> None:
        tree = self._tree_for(e.proc)
        node = tree.get(e.node_id)
        if node is None:
            node = tree[e.node_id] = TreeNodeView(e.node_id, e.parent_id, e.tokens, e.text, last_access=e.ts)
        else:
            node.parent_id, node.tokens, node.last_access = e.parent_id, e.tokens, e.ts
            node.text = e.text or node.text
        node.just_inserted, node.just_evicted = True, False
        self.ghosts.get(e.proc, {}).pop(e.node_id, None)  # back in the cache: no longer a ghost
        parent = tree.get(e.parent_id)
        if parent is not None and e.node_id not in parent.children:
            parent.children.append(e.node_id)

    def _on_evict(self, e: ev.CacheEvict) -> None:
        tree = self._tree_for(e.proc)
        for nid in e.node_ids:
            node = tree.get(nid)
            if node is not None:
                node.just_evicted = True
                # its ghost: last_access becomes the eviction's time (how long it stays on show)
                ghosts = self.ghosts.setdefault(e.proc, {})
                ghosts[nid] = replace(node, children=[], evicted_step=e.step, last_access=e.ts, lock_ref=0)
                if len(ghosts) > _MAX_GHOSTS:
                    ghosts.pop(next(iter(ghosts)))
        self.counters.evicted_tokens_total += e.tokens

    def _on_tree(self, e: ev.CacheTree) -> None:
        self._tree_for(e.proc)
        tree: dict[int, TreeNodeView] = {}
        for n in e.nodes:
            tree[n.node_id] = TreeNodeView(
                n.node_id, n.parent_id, n.tokens, n.text, n.lock_ref, n.hits, n.last_access, tier=n.tier
            )
        for n in e.nodes:
            parent = tree.get(n.parent_id)
            if parent is not None:
                parent.children.append(n.node_id)
        self.trees[e.proc] = tree
        ghosts = self.ghosts.get(e.proc)
        if ghosts:  # forget the ghosts back in the cache (HiCache keeps a node on host) or gone stale
            for nid in [nid for nid, g in ghosts.items() if nid in tree or not self._ghost_alive(g)]:
                del ghosts[nid]
        if e.proc == self.tree_proc:
            self.tree_evictable_size, self.tree_protected_size = e.evictable_size, e.protected_size

    # ---- processes, weights, the trace itself ---------------------------------

    def _on_weights(self, e: ev.WeightsUpdated) -> None:
        self.weights_version = e.version if e.version else self.weights_version + 1
        self.weights_source = e.source

    def _proc(self, e: ev.Event, role: str) -> ProcView:
        name = e.proc or role
        return self.procs.setdefault(name, ProcView(name))

    def _on_proc_started(self, e: ev.ProcStarted) -> None:
        p = self._proc(e, e.role)
        p.pid, p.role, p.alive, p.started_ts = e.pid, e.role, True, e.ts

    def _on_proc_exited(self, e: ev.ProcExited) -> None:
        p = self._proc(e, e.role)
        p.pid, p.role = e.pid, e.role or p.role
        p.alive, p.exited_ts, p.exitcode, p.reason = False, e.ts, e.exitcode, e.reason

    def _on_dropped(self, e: ev.TraceDropped) -> None:
        self.counters.dropped_events += e.count

    def _on_header(self, e: ev.TraceHeader) -> None:
        self.schema_version = e.schema_version
        if e.model:
            self.model = e.model

    def _on_counters(self, e: ev.TraceCounters) -> None:
        for name in Counters.__dataclass_fields__:
            setattr(self.counters, name, getattr(e, name))
        self.weights_version = e.weights_version
        if e.model:
            self.model = e.model

    def _on_req_snapshot(self, e: ev.ReqSnapshot) -> None:
        self._forget(e.rid)
        r, b = self._req(e.rid)
        for name in REQUEST_SNAPSHOT_FIELDS:
            setattr(r, name, getattr(e, name))
        r.timeline = [TimelineEntry(t.ts, t.kind, t.detail, t.end_ts, t.count, t.step) for t in e.timeline]
        r.steps = list(e.steps)
        # Bookkeeping consistent with what the snapshot says already happened, so the
        # events that follow neither re-count prefill chunks nor the first token.
        b.state_ts = max([e.ts] + [t.ts for t in e.timeline])
        b.round = e.retractions
        b.chunks = {(b.round, k): c for k, c in enumerate(e.round_chunks)}
        b.tl_chunks = set(b.chunks)
        this_round = sum(e.round_chunks)
        b.base_computed = e.computed_tokens - (this_round if b.round == 0 else 0)
        b.base_recomputed = e.recomputed_tokens - (this_round if b.round > 0 else 0)
        if e.round_sampled:
            b.sampled_rounds.add(b.round)
        if e.replica:
            self.req_replica[e.rid] = e.replica
        if e.lora:
            self.loras_seen = True
        if e.state in TERMINAL_STATES:
            b.final = b.counted_finish = True
            b.counted_abort = e.state == "aborted"
            self._mark_finished(e.rid, b)

    # ---- snapshots ------------------------------------------------------------

    def snapshot_events(self, max_finished: int = 100) -> list[ev.Event]:
        """Synthetic events that rebuild the current picture in a fresh TraceState:
        processes, counters, active requests (and the `max_finished` most recently
        finished), queues, KV usage and the radix tree(s). Step and history rings
        are not carried: they refill as new events arrive."""
        out: list[ev.Event] = []
        ts = self.last_ts
        for p in self.procs.values():
            if p.pid is not None:
                out.append(ev.ProcStarted(ts=p.started_ts or ts, proc=p.name, pid=p.pid, role=p.role))
                if not p.alive:
                    out.append(
                        ev.ProcExited(
                            ts=p.exited_ts or ts,
                            proc=p.name,
                            pid=p.pid,
                            role=p.role,
                            exitcode=p.exitcode,
                            reason=p.reason,
                        )
                    )
        out.append(self._counters_event(ts))
        recent = set(list(self._finished_order)[-max_finished:]) if max_finished > 0 else set()
        for r in self.requests.values():
            if r.state in TERMINAL_STATES and r.rid not in recent:
                continue
            b = self._books[r.rid]
            out.append(
                ev.ReqSnapshot(
                    ts=ts,
                    rid=r.rid,
                    **{name: getattr(r, name) for name in REQUEST_SNAPSHOT_FIELDS},
                    timeline=[ev.TimelineItem(t.ts, t.kind, t.detail, t.end_ts, t.count, t.step) for t in r.timeline],
                    steps=list(r.steps),
                    round_sampled=b.round in b.sampled_rounds,
                    replica=self.req_replica.get(r.rid, ""),
                    round_chunks=[
                        b.chunks.get((b.round, k), 0)
                        for k in range(1 + max([k for (rd, k) in b.chunks if rd == b.round], default=-1))
                    ],
                )
            )
        for q in self._queues.values():
            out.append(
                ev.QueueState(
                    ts=q.ts,
                    proc=q.proc,
                    step=q.step,
                    waiting=list(q.waiting),
                    running=list(q.running),
                    chunked=list(q.chunked),
                    held=list(q.held),
                )
            )
        for k in self.kv_by_proc.values():
            out.append(
                ev.KVUsage(
                    ts=k.ts, proc=k.proc, step=k.step, used=k.used, evictable=k.evictable, free=k.free, total=k.total
                )
            )
        for extra in (self.experts.snapshot_event(ts), self.spec.snapshot_event(ts)):
            if extra is not None:
                out.append(extra)
        for proc, tree in self.trees.items():
            nodes = [
                ev.TreeNode(n.node_id, n.parent_id, n.tokens, n.text, n.lock_ref, n.hits, n.last_access, n.tier)
                for n in tree.values()
                if not n.just_evicted
            ]
            ev_sz, pr_sz = (self.tree_evictable_size, self.tree_protected_size) if proc == self.tree_proc else (0, 0)
            out.append(ev.CacheTree(ts=ts, proc=proc, nodes=nodes, evictable_size=ev_sz, protected_size=pr_sz))
        return out

    def _counters_event(self, ts: int) -> ev.TraceCounters:
        fields = {k: getattr(self.counters, k) for k in Counters.__dataclass_fields__}
        return ev.TraceCounters(ts=ts, weights_version=self.weights_version, model=self.model, **fields)
