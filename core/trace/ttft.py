"""TTFT explained: a request's time to first token split into its parts, from traced timestamps.

TTFT is `req.first_token.ts - req.arrived.ts` (the tokenizer stamps both, and its `req.finished`
reports exactly that difference). The parts are the stretches between these moments:

    arrived ─(1)─ queued ─(2)─ start of the step that ran chunk 1 ─(3)─ end of that step ─(3)─ …
            ─ end of the step that ran the last chunk ─(4)─ first token

1. **arrived → queued**: tokenizing and the hand-over to the scheduler, which reads its input
   socket only between steps; a request that arrives during a long step waits for that step to end
   (the step is named: number, mode, duration).
2. **queued**: the steps that began after the scheduler queued it and did not admit it, and why
   (each step's `batch.decision`: token budget, KV room, running limit, held back for a shared
   prefix), and who got the prefill instead (for example a long prompt's chunks).
3. **prefill**, one part per chunk: the step that computed it and who shared that step.
4. **first token**: from the end of the last chunk's step until the tokenizer has the token
   (sampling, the detokenizer, the hop back to the tokenizer).

Every boundary is clamped into [previous boundary, first token], so no part is negative and the
parts always sum to the TTFT exactly (in ns), also when an event was lost or a step has left the
step ring (that part is then coarser, not wrong in total). Pure: a function of a TraceState, used
by the TUI's request detail and the Dashboard's Gantt alike. It reads the state through
`TracePicture`, the four attributes it needs, so this module does not import the reducer
(state.py imports it for TraceState.ttft_parts).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from workbench.core.trace.views import TERMINAL_STATES, RequestView, StepView


class TracePicture(Protocol):
    """What the breakdown reads off a TraceState (state.py's reducer writes these)."""

    @property
    def requests(self) -> Mapping[str, RequestView]: ...

    @property
    def steps(self) -> Iterable[StepView]:
        """The steps still in the ring."""
        ...

    @property
    def last_ts(self) -> int: ...

    @property
    def req_replica(self) -> Mapping[str, str]:
        """rid -> the scheduler process holding it (data parallel)."""
        ...


#: Part kinds, in order. A disaggregated (PD) request's decode side has its own between them:
#: "decode_queue", "prefill_queue" and "transfer" (core/trace/pd.py).
PART_KINDS = ("arrived", "queued", "decode_queue", "prefill_queue", "prefill", "transfer", "first_token", "paused")

# Why a step passed a waiting request over (StepDecision.stop_reason, or membership of `held`).
_PASSED_OVER = {
    "budget": "token budget",
    "kv": "no KV room",
    "running": "running limit",
    "finishing": "running limit (finished not filtered yet)",
    "held": "held limit",
    "shared": "held for a shared prefix",
}


def fmt_dur(ns: int) -> str:
    """A duration for people: 6.64 s, 412 ms, 3.1 ms, 0.2 ms."""
    s = ns / 1e9
    if s >= 1:
        return f"{s:.2f} s"
    ms = s * 1e3
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def step_start(sv: StepView) -> int:
    """When a step began (monotonic ns): its batch.decision's `start_ts` when traced, else its
    batch.step's ts (stamped when the forward is done) less the scheduling and forward time."""
    d = sv.decision
    if d is not None and d.start_ts:
        return d.start_ts
    return sv.ts - int((sv.schedule_ms + sv.forward_ms) * 1e6)


def step_busy_end(sv: StepView) -> int:
    """When the scheduler was done with a step: its batch.decision (the end of the iteration,
    results processed) or, without one, its batch.step."""
    d = sv.decision
    return max(sv.ts, d.ts) if d is not None else sv.ts


class StepIndex:
    """The steps still in a TraceState's ring, by id and by time. Build it once to explain many
    requests (a Gantt of 40 rows) instead of scanning the ring for each."""

    def __init__(self, state: TracePicture):
        self._by_id: dict[tuple[str, int], StepView] = {}
        self._by_step: dict[int, StepView] = {}
        rows = []
        for sv in state.steps:
            self._by_id[(sv.proc, sv.step)] = sv
            self._by_step[sv.step] = sv
            rows.append((step_start(sv), step_busy_end(sv), sv))
        rows.sort(key=lambda row: row[0])
        self._rows = rows
        self._starts = [row[0] for row in rows]
        self._longest = max((e - s for s, e, _ in rows), default=0)

    def get(self, step: int, proc: str | None = None) -> StepView | None:
        """Step `step` of scheduler `proc` (any scheduler when None: there is one without data parallelism)."""
        return self._by_step.get(step) if proc is None else self._by_id.get((proc, step))

    def overlapping(self, lo: int, hi: int, proc: str | None = None) -> list[tuple[int, int, StepView]]:
        """(start, end, step) of the steps whose time overlaps [lo, hi], by start."""
        i = bisect.bisect_right(self._starts, hi)
        j = bisect.bisect_left(self._starts, lo - self._longest)
        return [row for row in self._rows[j:i] if row[1] >= lo and (proc is None or row[2].proc == proc)]

    def starting(self, lo: int, hi: int, proc: str | None = None) -> list[StepView]:
        """The steps that began in [lo, hi), by start."""
        i, j = bisect.bisect_left(self._starts, lo), bisect.bisect_left(self._starts, hi)
        return [row[2] for row in self._rows[i:j] if proc is None or row[2].proc == proc]


@dataclass(frozen=True)
class TtftPart:
    """One stretch of a request's time to first token."""

    kind: str  # one of PART_KINDS
    label: str  # "arrived → queued", "queued", "chunk 2/3" (or "prefill"), "first token"
    start_ts: int  # monotonic ns
    end_ts: int
    detail: str = ""  # why it took this long, in words
    steps: tuple[int, ...] = ()  # the scheduler steps it covers (busy in / passed over by / ran)
    others: tuple[str, ...] = ()  # who got the prefill instead (queued) / shared the step (prefill)

    @property
    def ns(self) -> int:
        return self.end_ts - self.start_ts

    @property
    def seconds(self) -> float:
        return self.ns / 1e9


@dataclass(frozen=True)
class TtftBreakdown:
    """A request's TTFT in parts (see the module docstring). `partial`: no first token yet; the
    parts run to `end_ts` (the trace's last moment, or the abort)."""

    rid: str
    arrival_ts: int
    end_ts: int  # the first token's ts (or, partial, the last moment known)
    parts: tuple[TtftPart, ...]
    partial: bool = False

    @property
    def ttft_ns(self) -> int:
        """Exactly the sum of the parts."""
        return self.end_ts - self.arrival_ts

    @property
    def ttft(self) -> float:
        return self.ttft_ns / 1e9

    def summary(self) -> str:
        """One line: `TTFT 7.73 s = 6.64 s arrived → queued + 410 ms queued + 620 ms prefill (2 chunks)
        + 60 ms first token` (`so far` instead of TTFT while there is no first token)."""
        pre = [p for p in self.parts if p.kind == "prefill"]
        terms = []
        for p in self.parts:
            if p.kind != "prefill":
                terms.append(f"{fmt_dur(p.ns)} {p.label}")
            elif p is pre[0]:  # the chunks as one term, where the first one is
                n = sum(1 for p in pre if p.steps)  # chunks (not the stretch since the last one)
                terms.append(f"{fmt_dur(sum(p.ns for p in pre))} prefill" + (f" ({n} chunks)" if n > 1 else ""))
        head = "so far" if self.partial else "TTFT"
        return f"{head} {fmt_dur(self.ttft_ns)} = " + " + ".join(terms)


def ttft_breakdown(
    state: TracePicture, rid: str, index: StepIndex | None = None, now_ns: int | None = None, paused: bool = False
) -> TtftBreakdown | None:
    """The TTFT of request `rid` in parts (TraceState.ttft_parts); None when its arrival is not
    in the trace. A request without a first token yet gets the parts so far (`partial`). This is
    one server's view: TraceState.ttft_parts splits the decode side of a disaggregated request
    along its journey across both servers instead (core/trace/pd.py).

    `now_ns` (a live view's clock): a request still waiting for its first token has its TTFT so
    far up to now, the same figure as the Queues' `so far` (now - arrival); the stretch since the
    trace's last event is a part of its own, "paused" when the scheduler is (`paused`), else "no
    step since"."""
    r = state.requests.get(rid)
    if r is None or r.arrival_ts is None:
        return None
    partial = r.first_token_ts is None
    end: int
    if r.first_token_ts is not None:
        end = r.first_token_ts
    elif r.state in TERMINAL_STATES:
        end = r.finish_ts if r.finish_ts is not None else state.last_ts
    else:
        end = state.last_ts
    t0: int = r.arrival_ts
    end = max(end, t0)
    idx = index if index is not None else StepIndex(state)
    proc = state.req_replica.get(rid)
    # This round's prefill chunks: those before the first token (a retraction's re-prefill comes
    # after it and is not part of the TTFT).
    chunks = []
    for e in r.timeline:
        if e.kind == "prefill" and e.ts <= end:
            sv = idx.get(e.step, proc) if e.step >= 0 else None
            if sv is not None and not any(x.rid == rid for x in sv.reqs):
                sv = None
            chunks.append((e, sv, step_start(sv) if sv is not None else e.ts, sv.ts if sv is not None else e.ts))
    # The moments between parts, clamped so that they never go back and never pass `end`.
    lo = t0

    def at(ts: int) -> int:
        nonlocal lo
        lo = min(max(ts, lo), end)
        return lo

    queued_ts = r.queued_ts if r.queued_ts is not None else (chunks[0][2] if chunks else end)
    q = at(queued_ts)
    first = at(chunks[0][2] if chunks else end)
    not_queued = r.queued_ts is None and not chunks  # the scheduler has not taken it in (yet)
    parts = [_arrived_part(idx, proc, t0, q, not_queued)]
    if not (not_queued and partial):
        parts.append(_queued_part(idx, proc, rid, q, first, chunks[0][1] if chunks else None))
    prev, prev_step = first, None
    n = len(chunks)
    for k, (e, sv, _, t) in enumerate(chunks):
        stop = at(t)
        parts.append(_chunk_part(rid, e, sv, k, n, prev, stop, prev_step))
        prev, prev_step = stop, e.step
    if not partial:
        parts.append(
            TtftPart(
                "first_token",
                "first token",
                prev,
                end,
                (f"sampled at the end of step {prev_step}, then " if prev_step is not None else "")
                + "detokenized and handed back to the tokenizer",
            )
        )
    elif prev < end:  # still going: the stretch since the last chunk, so the parts reach `end`
        parts.append(
            TtftPart(
                "prefill",
                "since the last chunk",
                prev,
                end,
                "waiting for the next chunk" if r.state == "prefilling" else "waiting for the token",
            )
        )
    if partial and now_ns is not None and now_ns > end and r.state not in TERMINAL_STATES:
        label = "paused" if paused else "no step since"
        why = "the scheduler is paused: no step runs until it resumes (s runs one)" if paused else ""
        parts.append(TtftPart("paused", label, end, now_ns, why or "no event for it since the trace's last one"))
        end = now_ns
    return TtftBreakdown(rid, t0, end, tuple(parts), partial)


def _arrived_part(idx: StepIndex, proc: str | None, t0: int, t1: int, not_queued: bool) -> TtftPart:
    label = "arrived (not queued yet)" if not_queued else "arrived → queued"
    busy = idx.overlapping(t0, t1, proc) if t1 > t0 else []
    if not busy:
        return TtftPart(
            "arrived",
            label,
            t0,
            t1,
            "tokenized and handed to the scheduler, which was between steps" if t1 > t0 else "",
        )
    # The step that kept the scheduler from reading its input the longest.
    s, e, sv = max(busy, key=lambda row: min(row[1], t1) - max(row[0], t0))
    more = f" (and {_plural(len(busy) - 1, 'more step')})" if len(busy) > 1 else ""
    detail = (
        f"the scheduler was inside step {sv.step} ({sv.mode}, {fmt_dur(e - s)}, "
        f"{_plural(len(sv.reqs), 'request')}){more}; new requests wait for a step's end"
    )
    return TtftPart("arrived", label, t0, t1, detail, tuple(x.step for _, _, x in busy))


def _queued_part(
    idx: StepIndex, proc: str | None, rid: str, t1: int, t2: int, admitted_by: StepView | None
) -> TtftPart:
    passed = [sv for sv in idx.starting(t1, t2, proc) if sv is not admitted_by]
    if not passed:
        who = f"step {admitted_by.step}" if admitted_by is not None else "the next step"
        return TtftPart(
            "queued",
            "queued",
            t1,
            t2,
            f"admitted by {who}, the first to start after it was queued" if admitted_by is not None else "",
        )
    why: Counter = Counter()
    went_to: Counter = Counter()
    chunked: set[str] = set()
    ahead: list[str] = []
    for sv in passed:
        d = sv.decision
        if d is not None:
            if rid in d.held:
                why["shared"] += 1
            elif d.stop_reason:
                why[d.stop_reason] += 1
                if d.stop_rid and d.stop_rid != rid and d.stop_rid not in ahead:
                    ahead.append(d.stop_rid)
            if d.chunk_continued:
                chunked.add(d.chunk_continued)
        for x in sv.reqs:
            if x.computed > 0:
                went_to[x.rid] += 1
                if x.chunk_index > 0:
                    chunked.add(x.rid)
    detail = f"passed over by {_plural(len(passed), 'step')}"
    if why:
        detail += ": " + ", ".join(f"{_PASSED_OVER.get(k, k)} ×{c}" for k, c in why.most_common())
    if ahead:
        detail += f", queued behind {', '.join(ahead[:3])}" + (" …" if len(ahead) > 3 else "")
    if went_to:
        top = [f"{o} ({'chunked ' if o in chunked else ''}×{c})" for o, c in went_to.most_common(3)]
        detail += " · the prefill went to " + ", ".join(top) + (" …" if len(went_to) > 3 else "")
    decodes = sum(1 for sv in passed if sv.mode == "decode")
    if decodes:
        detail += f" · {_plural(decodes, 'decode step')}"
    return TtftPart("queued", "queued", t1, t2, detail, tuple(sv.step for sv in passed), tuple(went_to))


def _chunk_part(rid: str, e, sv: StepView | None, k: int, n: int, t1: int, t2: int, prev_step: int | None) -> TtftPart:
    # The chunks are counted here, after the fact: n is what really ran, not the scheduler's estimate.
    label = f"chunk {k + 1}/{n}" if n > 1 else "prefill"
    if sv is None:
        what = e.detail.split(": ", 1)[-1]
        return TtftPart("prefill", label, t1, t2, f"step {e.step}: {what}", (e.step,))
    mine = next(x for x in sv.reqs if x.rid == rid)
    what = f"{mine.cached} cached + {mine.computed} computed" if k == 0 else f"{mine.computed} computed"
    others = [x.rid for x in sv.reqs if x.rid != rid]
    detail = f"step {sv.step} {sv.mode}: {what}"
    if others:
        total = sum(x.computed for x in sv.reqs)
        detail += (
            f", with {', '.join(others[:4])}"
            + (f" +{len(others) - 4} more" if len(others) > 4 else "")
            + f" ({total} tokens computed in all)"
        )
    else:
        detail += ", alone"
    if prev_step is not None and sv.step > prev_step + 1:
        detail += f" · sat out {_plural(sv.step - prev_step - 1, 'step')} since its last chunk"
    if k == 0 and mine.cached and sv.decision is not None:
        # HiCache: cached tokens this step first brought back from host / storage (the step's, not per request)
        loaded = [p for p in sv.decision.hicache if p.startswith(("loaded back", "prefetched"))]
        if loaded:
            detail += " · this step " + ", ".join(loaded)
    return TtftPart("prefill", label, t1, t2, detail, (sv.step,), tuple(others))
