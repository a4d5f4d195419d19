"""Export trace events as Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing).

Layout:
- one process track per emitting process (scheduler, tokenizer, ...), named
  by "M" metadata events; each `batch.step` is a complete slice ("X") on its
  process, spanning [ts - forward_ms, ts] (the scheduler emits batch.step
  after the forward), with the batch composition in args and, joined by
  (proc, step), that step's `batch.decision`: who was admitted, why the others
  waited, KV slots + (allocated) and - (freed), held after the step, the
  releases, evictions and retractions, plus a one-line `decision` summary;
  evictions and retractions are also instants ("i") on the scheduler track;
- a "requests" process holding one async track per request: a "request"
  slice ("b"/"e", id = rid, cat "request") with nested stages named as
  SGLang's request stages: prefill_waiting -> prefill_forward -> decode_loop,
  one "chunked_prefill" slice per chunk inside prefill_forward when a prefill
  was chunked (args: chunk k of n and its token range [start, end) in the
  prompt), and instants ("n") for first token and retraction;
- counters ("C"): queue lengths, KV tokens, tokens per step.

Timestamps are microseconds relative to the first event.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
from workbench.core.trace import events as ev

REQUESTS_PID = 1
_MAX_STEP_REQS_IN_ARGS = 64


# SGLang's request stage names (its RequestStage), used for the per-request slices and spans.
STAGE_WAITING = "prefill_waiting"
STAGE_PREFILL = "prefill_forward"
STAGE_CHUNK = "chunked_prefill"
STAGE_DECODE = "decode_loop"


@dataclass
class PrefillChunk:
    """One prefill chunk of a request: the step that computed prompt tokens [token_start, token_end)."""

    step: int
    start: int  # monotonic ns: the step's forward began ...
    end: int  # ... and ended
    chunk_index: int
    num_chunks: int
    token_start: int
    token_end: int

    def args(self) -> dict:
        return {
            "step": self.step,
            "chunk": f"{self.chunk_index + 1}/{self.num_chunks}",
            "chunk_index": self.chunk_index,
            "num_chunks": self.num_chunks,
            "token_start": self.token_start,
            "token_end": self.token_end,
            "tokens": self.token_end - self.token_start,
        }


class ChunkTracker:
    """Folds `batch.step` events into each request's prefill chunks with their token ranges: a round
    of prefill starts at chunk 0 after the cached prefix (again after a retraction), and each chunk
    continues where the one before it ended."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[PrefillChunk]] = {}
        self._next: dict[str, int] = {}

    def add_step(self, e: ev.BatchStep) -> None:
        start = e.ts - int(e.forward_ms * 1e6)
        for r in e.reqs:
            if not r.computed:
                continue
            if r.chunk_index == 0 or r.rid not in self._next:
                self._next[r.rid] = r.cached
            a = self._next[r.rid]
            self._next[r.rid] = a + r.computed
            self.chunks.setdefault(r.rid, []).append(
                PrefillChunk(e.step, start, e.ts, r.chunk_index, r.num_chunks, a, a + r.computed)
            )

    def pop(self, rid: str) -> list[PrefillChunk]:
        self._next.pop(rid, None)
        return self.chunks.pop(rid, [])


def decision_args(d: ev.StepDecision) -> dict:
    """A `batch.decision` as flat args (Perfetto) or attributes (OpenTelemetry): lists of strings and
    numbers only. `kv_plus`/`kv_minus`: the KV slots the step allocated and freed."""
    return {
        "decision": decision_summary(d),
        "admitted": list(d.admitted),
        "chunk_continued": d.chunk_continued,
        "waiting": d.waiting,
        "stop_reason": d.stop_reason,
        "stop_rid": d.stop_rid,
        "held": list(d.held),
        "budget": d.budget,
        "budget_used": d.budget_used,
        "running_waited": d.running_waited,
        "kv_plus": d.kv_alloc,
        "kv_minus": d.kv_freed,
        "kv_reused": d.kv_reused,
        "kv_returned": d.kv_returned,
        "kv_other": d.kv_other,
        "kv_held": d.kv_held,
        "released": [f"{r.rid} {r.why} {r.slots}" for r in d.released],
        "evicted": d.evicted,
        "evicted_nodes": list(d.evicted_nodes),
        "retracted": list(d.retracted),
        "preemptions": list(d.preemptions),
    }


_STOP_WORDS = {
    "budget": "prefill token budget",
    "kv": "KV room",
    "running": "running limit",
    "held": "held for a shared prefix",
}


def decision_summary(d: ev.StepDecision) -> str:
    """One line: `admitted a b · chunk of c · 3 waiting: KV room (r7) · KV +34 −10 · held 152 · evicted 12 (2 nodes)`."""
    parts = []
    if d.admitted:
        parts.append("admitted " + " ".join(d.admitted))
    if d.chunk_continued:
        parts.append(f"chunk of {d.chunk_continued}")
    if d.waiting:
        why = _STOP_WORDS.get(d.stop_reason, d.stop_reason)
        parts.append(f"{d.waiting} waiting" + (f": {why}" if why else "") + (f" ({d.stop_rid})" if d.stop_rid else ""))
    if d.held:
        parts.append("held back " + " ".join(d.held))
    parts.append(f"KV +{d.kv_alloc} −{d.kv_freed}")
    if d.kv_held >= 0:
        parts.append(f"held {d.kv_held} slots")
    if d.released:
        parts.append("released " + ", ".join(f"{r.rid} {r.why} {r.slots}" for r in d.released))
    if d.evicted:
        parts.append(f"evicted {d.evicted} ({len(d.evicted_nodes)} node{'s' * (len(d.evicted_nodes) != 1)})")
    if d.retracted:
        parts.append("retracted " + " ".join(d.retracted))
    return " · ".join(parts)


@dataclass
class _ReqSpan:
    arrival: int | None = None
    queued: int | None = None
    prefill_start: int | None = None
    prefill_end: int | None = None
    decoded: bool = False
    first_token: int | None = None
    finish: int | None = None
    reason: str = ""
    first_seen: int | None = None
    last_seen: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    chunks: list[PrefillChunk] = field(default_factory=list)


def build_trace_events(events: Iterable[ev.Event]) -> dict:
    """The trace-event JSON document as a dict (see module docstring)."""
    events = [e for e in events if e.ts]
    out: list[dict] = []
    if not events:
        return {"traceEvents": out, "displayTimeUnit": "ms"}
    t0 = min(e.ts for e in events)

    def us(ts: int) -> float:
        return (ts - t0) / 1000.0

    pids: dict[str, int] = {}

    def pid_of(proc: str) -> int:
        proc = proc or "unknown"
        if proc not in pids:
            pids[proc] = len(pids) + REQUESTS_PID + 1
            out.append(
                {"name": "process_name", "ph": "M", "ts": 0, "pid": pids[proc], "tid": 0, "args": {"name": proc}}
            )
            out.append(
                {"name": "thread_name", "ph": "M", "ts": 0, "pid": pids[proc], "tid": 1, "args": {"name": "main"}}
            )
        return pids[proc]

    out.append(
        {"name": "process_name", "ph": "M", "ts": 0, "pid": REQUESTS_PID, "tid": 0, "args": {"name": "requests"}}
    )
    out.append(
        {"name": "process_sort_index", "ph": "M", "ts": 0, "pid": REQUESTS_PID, "tid": 0, "args": {"sort_index": 0}}
    )
    reqs: dict[str, _ReqSpan] = {}
    instants: list[dict] = []
    # A step's decision joins its batch.step by (proc, step): it comes after the step in the normal
    # loop and before it in the overlap loop, so gather them first.
    decisions = {(e.proc, e.step): e for e in events if type(e) is ev.StepDecision}
    joined: set[tuple[str, int]] = set()
    chunks = ChunkTracker()

    def span(rid: str, ts: int) -> _ReqSpan:
        r = reqs.get(rid)
        if r is None:
            r = reqs[rid] = _ReqSpan(first_seen=ts)
        r.first_seen = min(r.first_seen, ts) if r.first_seen is not None else ts
        r.last_seen = max(r.last_seen, ts)
        return r

    # `type(e) is` in every branch (not a saved `type(e)`), so the type checker narrows `e`.
    for e in events:
        if type(e) is ev.BatchStep:
            pid = pid_of(e.proc)
            start = e.ts - int(e.forward_ms * 1e6)
            pre = sum(r.computed for r in e.reqs)
            cached = sum(r.cached for r in e.reqs if r.computed and r.chunk_index == 0)
            dec = sum(r.decode for r in e.reqs if not r.computed)
            decision = decisions.get((e.proc, e.step))
            if decision is not None:
                joined.add((e.proc, e.step))
            chunks.add_step(e)
            out.append(
                {
                    "name": f"{e.mode} bs={e.batch_size}",
                    "cat": "step",
                    "ph": "X",
                    "ts": us(start),
                    "dur": e.forward_ms * 1000.0,
                    "pid": pid,
                    "tid": 1,
                    "args": {
                        "step": e.step,
                        "mode": e.mode,
                        "batch_size": e.batch_size,
                        "padded_size": e.padded_size,
                        "cuda_graph": e.cuda_graph,
                        "backend": e.backend,
                        "schedule_ms": e.schedule_ms,
                        "forward_ms": e.forward_ms,
                        "prefill_tokens": pre,
                        "cached_tokens": cached,
                        "decode_tokens": dec,
                        "reqs": [
                            [r.rid, r.cached, r.computed, r.decode, r.chunk_index, r.num_chunks]
                            for r in e.reqs[:_MAX_STEP_REQS_IN_ARGS]
                        ],
                    }
                    | (decision_args(decision) if decision is not None else {}),
                }
            )
            out.append(
                {
                    "name": "tokens",
                    "ph": "C",
                    "ts": us(e.ts),
                    "pid": pid,
                    "tid": 1,
                    "args": {"prefill": pre, "cached": cached, "decode": dec},
                }
            )
            for sr in e.reqs:
                r = span(sr.rid, start)
                r.last_seen = max(r.last_seen, e.ts)
                if sr.computed:
                    r.prefill_start = start if r.prefill_start is None else min(r.prefill_start, start)
                    r.prefill_end = e.ts if r.prefill_end is None else max(r.prefill_end, e.ts)
                elif sr.decode:
                    r.decoded = True
        elif type(e) is ev.StepDecision:
            pid = pid_of(e.proc)
            for rid in e.retracted:
                out.append(
                    {
                        "name": "retract",
                        "ph": "i",
                        "s": "t",
                        "ts": us(e.ts),
                        "pid": pid,
                        "tid": 1,
                        "args": {"rid": rid, "step": e.step, "preemptions": list(e.preemptions)},
                    }
                )
        elif type(e) is ev.QueueState:
            out.append(
                {
                    "name": "queue",
                    "ph": "C",
                    "ts": us(e.ts),
                    "pid": pid_of(e.proc),
                    "tid": 1,
                    "args": {"waiting": len(e.waiting), "running": len(e.running), "chunked": len(e.chunked)},
                }
            )
        elif type(e) is ev.KVUsage:
            out.append(
                {
                    "name": "kv_tokens",
                    "ph": "C",
                    "ts": us(e.ts),
                    "pid": pid_of(e.proc),
                    "tid": 1,
                    "args": {"used": e.used, "evictable": e.evictable, "free": e.free},
                }
            )
        elif type(e) is ev.ReqArrived:
            span(e.rid, e.ts).arrival = e.ts
        elif type(e) is ev.ReqTokenized:
            span(e.rid, e.ts).prompt_tokens = e.prompt_tokens
        elif type(e) is ev.ReqQueued:
            r = span(e.rid, e.ts)
            r.queued = e.ts if r.queued is None else min(r.queued, e.ts)
        elif type(e) is ev.ReqScheduled:
            span(e.rid, e.ts)
        elif type(e) is ev.ReqFirstToken:
            span(e.rid, e.ts).first_token = e.ts
            instants.append(
                {
                    "name": "first_token",
                    "cat": "request",
                    "ph": "n",
                    "id": e.rid,
                    "ts": us(e.ts),
                    "pid": REQUESTS_PID,
                    "tid": 0,
                }
            )
        elif type(e) is ev.ReqRetracted:
            span(e.rid, e.ts)
            instants.append(
                {
                    "name": "retracted",
                    "cat": "request",
                    "ph": "n",
                    "id": e.rid,
                    "ts": us(e.ts),
                    "pid": REQUESTS_PID,
                    "tid": 0,
                    "args": {"output_tokens": e.output_tokens},
                }
            )
        elif type(e) is ev.ReqFinished:
            r = span(e.rid, e.ts)
            r.finish, r.reason = e.ts, e.reason
            r.prompt_tokens, r.output_tokens, r.cached_tokens = (e.prompt_tokens, e.completion_tokens, e.cached_tokens)
        elif type(e) is ev.ReqAborted:
            r = span(e.rid, e.ts)
            if r.finish is None:
                r.finish, r.reason = e.ts, "abort"
        elif type(e) in (ev.ProcStarted, ev.ProcExited, ev.WeightsUpdated, ev.TraceDropped):
            args = msgspec.structs.asdict(e)
            for k in ("ts", "proc", "step"):
                args.pop(k, None)
            out.append(
                {
                    "name": e.__struct_config__.tag,
                    "ph": "i",
                    "s": "p",
                    "ts": us(e.ts),
                    "pid": pid_of(e.proc),
                    "tid": 1,
                    "args": args,
                }
            )
        elif type(e) is ev.CacheEvict:
            out.append(
                {
                    "name": "cache.evict",
                    "ph": "i",
                    "s": "t",
                    "ts": us(e.ts),
                    "pid": pid_of(e.proc),
                    "tid": 1,
                    "args": {
                        "nodes": len(e.node_ids),
                        "node_ids": list(e.node_ids),
                        "tokens": e.tokens,
                        "step": e.step,
                    },
                }
            )

    # A decision whose batch.step is not in the trace (an idle step, a cut recording): an instant.
    for key, d in decisions.items():
        if key not in joined:
            out.append(
                {
                    "name": "batch.decision",
                    "ph": "i",
                    "s": "t",
                    "ts": us(d.ts),
                    "pid": pid_of(d.proc),
                    "tid": 1,
                    "args": {"step": d.step} | decision_args(d),
                }
            )
    for rid, r in reqs.items():
        r.chunks = chunks.pop(rid)
        out.extend(_request_slices(rid, r, us))
    out.extend(instants)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _request_slices(rid: str, r: _ReqSpan, us) -> list[dict]:
    start = min(x for x in (r.arrival, r.queued, r.prefill_start, r.first_seen) if x is not None)
    end = max(x for x in (r.finish, r.last_seen, start) if x is not None)
    res: list[dict] = []

    def slice_(name: str, a: int, b: int, args: dict | None = None) -> None:
        a, b = max(a, start), min(b, end)
        if b < a:
            return
        begin = {"name": name, "cat": "request", "ph": "b", "id": rid, "ts": us(a), "pid": REQUESTS_PID, "tid": 0}
        if args:
            begin["args"] = args
        res.append(begin)
        res.append({"name": name, "cat": "request", "ph": "e", "id": rid, "ts": us(b), "pid": REQUESTS_PID, "tid": 0})

    slice_(
        "request",
        start,
        end,
        {
            "rid": rid,
            "finish_reason": r.reason,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "cached_tokens": r.cached_tokens,
        },
    )
    outer_end = res.pop()  # stages nest inside: emit them before the outer "e"
    q0 = r.queued if r.queued is not None else r.arrival
    if q0 is not None:
        slice_(STAGE_WAITING, q0, r.prefill_start if r.prefill_start is not None else end)
    if r.prefill_start is not None and r.prefill_end is not None:  # set together
        chunked = [c for c in r.chunks if c.num_chunks > 1]
        whole = r.chunks[-1].args() if len(r.chunks) == 1 else {"chunks": len(r.chunks)}
        slice_(STAGE_PREFILL, r.prefill_start, r.prefill_end, whole)
        if chunked:  # one slice per chunk, nested in prefill_forward
            stage_end = res.pop()
            last = r.prefill_start
            for c in chunked:
                a = max(c.start, last)  # never overlap the chunk before (async slices must nest)
                last = max(a, c.end)
                slice_(STAGE_CHUNK, a, last, c.args())
            res.append(stage_end)
        if r.decoded or (r.finish is not None and r.finish > r.prefill_end):
            slice_(STAGE_DECODE, r.prefill_end, end)
    res.append(outer_end)
    return res


def export_perfetto(events: Iterable[ev.Event], out_path: str | os.PathLike[str]) -> dict:
    """Write `events` as Chrome trace-event JSON to out_path; returns the document."""
    doc = build_trace_events(events)
    with open(out_path, "wb") as f:
        f.write(msgspec.json.encode(doc))
    return doc
