"""OpenTelemetry export: one trace per request, with a span per stage (SGLang's stage names).

A bus callback (like the Recorder) that folds events into its own `TraceState` and, when a
request ends, turns its `RequestView` into spans:

    request <rid>                arrival .. finish     prompt/completion/cached tokens, TTFT, TPOT, reason
      │                                                events: admitted (the step's decision), released
      ├─ prefill_waiting         queued .. first prefill chunk           (events: why it waited, each new reason)
      ├─ prefill_forward         first prefill chunk .. first token
      │    └─ chunked_prefill    one span per chunk of a chunked prefill: its step and token range
      └─ decode_loop             first token .. finish                   (retractions as span events)

With `steps=True` each scheduler step is also a trace of its own: a `scheduler_step` span with the
step's batch and decision (admitted, reasons, KV + and -, held slots, releases, evictions,
retractions) as attributes and its evictions and retractions as span events. Off by default: a busy
server runs tens of steps a second.

Trace timestamps are monotonic ns (comparable across processes on one host); spans need wall-clock
epoch ns, so one offset, taken when the exporter starts, converts them.

Optional: needs `opentelemetry-sdk` (`pip install 'serving-workbench[otel]'`), and for an OTLP
endpoint `opentelemetry-exporter-otlp-proto-http`. `workbench serve --otlp-traces-endpoint
http://127.0.0.1:4318/v1/traces` turns it on; tests pass an in-memory exporter instead.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from workbench.core.trace import events as ev
from workbench.core.trace.perfetto import (
    STAGE_CHUNK,
    STAGE_DECODE,
    STAGE_PREFILL,
    STAGE_WAITING,
    ChunkTracker,
    decision_args,
    decision_summary,
)
from workbench.core.trace.state import TraceState
from workbench.core.trace.views import RequestView

INSTALL_HINT = "pip install 'opentelemetry-sdk>=1.20' 'opentelemetry-exporter-otlp-proto-http>=1.20'"


def _require_sdk():
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise ValueError(f"OpenTelemetry export needs the SDK; install it with `{INSTALL_HINT}`") from None
    return TracerProvider, BatchSpanProcessor, SimpleSpanProcessor


def otlp_span_exporter(endpoint: str):
    """An OTLP/HTTP span exporter for `endpoint` (e.g. http://127.0.0.1:4318/v1/traces)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ValueError(f"--otlp-traces-endpoint needs the OTLP exporter; install it with `{INSTALL_HINT}`") from None
    return OTLPSpanExporter(endpoint=endpoint)


class OtelExporter:
    """Bus callback turning finished requests into OpenTelemetry spans.

    Args:
        span_exporter: any SDK `SpanExporter` (OTLP, console, in-memory).
        service_name: the `service.name` resource attribute.
        batch: export through a BatchSpanProcessor (background thread); False exports synchronously.
        steps: also export one `scheduler_step` span per scheduler step, with its decision.
    """

    _MAX_PENDING_STEPS = 64  # steps waiting for their decision (or the reverse) before going out bare
    _MAX_REMEMBERED = 4096  # requests remembered (exported, or with decisions noted)

    def __init__(
        self,
        span_exporter,
        service_name: str = "serving-workbench",
        model: str = "",
        batch: bool = True,
        steps: bool = False,
    ):
        TracerProvider, BatchSpanProcessor, SimpleSpanProcessor = _require_sdk()
        from opentelemetry.sdk.resources import Resource

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        processor = BatchSpanProcessor(span_exporter) if batch else SimpleSpanProcessor(span_exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("workbench.trace")
        self.model = model
        # Only finished requests matter here; small caps keep memory flat on a long run.
        self.state = TraceState(max_steps=16, max_history=16, max_finished=256)
        self.exported = 0
        self._lock = threading.Lock()
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self.steps = steps
        self._chunks = ChunkTracker()
        # Per request, until it ends: (ts, name, attributes) of the decisions that concerned it.
        self._notes: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}
        self._waited: dict[str, str] = {}  # the last reason a request waited for (one event per new reason)
        self._step_ev: dict[tuple[str, int], ev.BatchStep] = {}
        self._step_dec: dict[tuple[str, int], ev.StepDecision] = {}
        self._step_evicts: dict[tuple[str, int], list[ev.CacheEvict]] = {}
        # Requests already exported (an abort after a finish must not export a second trace).
        self._done: dict[str, None] = {}

    def __call__(self, batch: list[ev.Event]) -> None:
        ended = []
        with self._lock:
            for e in batch:
                self.state.apply(e)
                if isinstance(e, (ev.ReqFinished, ev.ReqAborted)):
                    ended.append(e.rid)
                elif type(e) is ev.BatchStep:
                    self._chunks.add_step(e)
                    if self.steps:
                        self._pair((e.proc, e.step), step=e)
                elif type(e) is ev.StepDecision:
                    self._note_decision(e)
                    if self.steps:
                        self._pair((e.proc, e.step), decision=e)
                elif type(e) is ev.CacheEvict and self.steps:
                    self._step_evicts.setdefault((e.proc, e.step), []).append(e)
            for rid in dict.fromkeys(ended):
                view = self.state.requests.get(rid)
                if view is not None and view.done and rid not in self._done:
                    self.export_request(view)
                    self._done[rid] = None
            while len(self._done) > self._MAX_REMEMBERED:
                del self._done[next(iter(self._done))]
            while len(self._notes) > self._MAX_REMEMBERED:  # requests whose end never came
                self._waited.pop(next(iter(self._notes)), None)
                del self._notes[next(iter(self._notes))]
            while len(self._step_evicts) > self._MAX_PENDING_STEPS:  # steps that never came
                del self._step_evicts[next(iter(self._step_evicts))]

    def _note_decision(self, d: ev.StepDecision) -> None:
        """Keep what a step decided about each request, for that request's spans."""
        step_attrs = {
            "step": d.step,
            "decision": decision_summary(d),
            "kv_plus": d.kv_alloc,
            "kv_minus": d.kv_freed,
            "kv_held": d.kv_held,
        }
        for rid in d.admitted:
            self._done.pop(rid, None)  # a rid used again
            self._notes.setdefault(rid, []).append((d.ts, "admitted", step_attrs))
        waits = {rid: "held for a shared prefix" for rid in d.held}
        if d.stop_rid and d.stop_rid not in d.admitted:
            waits[d.stop_rid] = d.stop_reason
        for rid, why in waits.items():
            if self._waited.get(rid) != why:
                self._waited[rid] = why
                self._notes.setdefault(rid, []).append((d.ts, "waiting", {"step": d.step, "reason": why}))
        for r in d.released:
            if r.rid in self._done:  # its release came in after its trace went out
                continue
            self._notes.setdefault(r.rid, []).append(
                (d.ts, "released", {"step": d.step, "why": r.why, "slots": r.slots})
            )

    def export_request(self, r: RequestView) -> None:
        """Emit the spans of one finished or aborted request."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        start = r.arrival_ts or r.queued_ts or r.finish_ts
        if start is None:
            return
        end = r.finish_ts or start
        prefill = [t for t in r.timeline if t.kind == "prefill"]
        attrs: dict[str, Any] = {
            "workbench.rid": r.rid,
            "gen_ai.request.model": self.model,
            "gen_ai.usage.input_tokens": r.prompt_tokens,
            "gen_ai.usage.output_tokens": r.output_tokens,
            "workbench.cached_tokens": r.cached_tokens,
            "workbench.computed_tokens": r.computed_tokens,
            "workbench.finish_reason": r.finish_reason or r.state,
            "workbench.retractions": r.retractions,
        }
        attrs.update(
            {
                k: v
                for k, v in (("workbench.ttft_s", r.ttft), ("workbench.tpot_s", r.tpot), ("workbench.e2e_s", r.e2e))
                if v is not None
            }
        )
        root = self.tracer.start_span(f"request {r.rid}", start_time=self._wall(start), attributes=attrs)
        ctx = trace.set_span_in_context(root)
        first_prefill = prefill[0].ts if prefill else None
        notes = self._notes.pop(r.rid, [])
        self._waited.pop(r.rid, None)
        chunks = self._chunks.pop(r.rid)
        for ts, name, a in notes:
            if name != "waiting":
                root.add_event(name, {f"workbench.{k}": v for k, v in a.items()}, timestamp=self._wall(ts))
        waiting = self.tracer.start_span(STAGE_WAITING, context=ctx, start_time=self._wall(r.queued_ts or start))
        for ts, name, a in notes:
            if name == "waiting":
                waiting.add_event(name, {f"workbench.{k}": v for k, v in a.items()}, timestamp=self._wall(ts))
        waiting.end(end_time=self._wall(max(r.queued_ts or start, first_prefill or end)))
        if first_prefill is not None:
            span = self.tracer.start_span(
                STAGE_PREFILL,
                context=ctx,
                start_time=self._wall(first_prefill),
                attributes={"workbench.chunks": len(chunks) or len(prefill)},
            )
            sctx = trace.set_span_in_context(span)
            for c in chunks:
                if c.num_chunks > 1:
                    child = self.tracer.start_span(
                        STAGE_CHUNK,
                        context=sctx,
                        start_time=self._wall(c.start),
                        attributes={f"workbench.{k}": v for k, v in c.args().items()},
                    )
                    child.end(end_time=self._wall(c.end))
            span.end(end_time=self._wall(r.first_token_ts or end))
        if r.first_token_ts is not None:
            span = self.tracer.start_span(
                STAGE_DECODE,
                context=ctx,
                start_time=self._wall(r.first_token_ts),
                attributes={"workbench.output_tokens": r.output_tokens},
            )
            for t in r.timeline:
                if t.kind == "retracted":
                    span.add_event("retracted", {"detail": t.detail}, timestamp=self._wall(t.ts))
            span.end(end_time=self._wall(end))
        if r.state == "aborted":
            root.set_status(Status(StatusCode.ERROR, r.finish_reason or "aborted"))
        root.end(end_time=self._wall(end))
        self.exported += 1

    def _pair(
        self, key: tuple[str, int], step: ev.BatchStep | None = None, decision: ev.StepDecision | None = None
    ) -> None:
        """Export a step's span once both its batch.step and its decision are in (either comes first)."""
        if step is not None:
            self._step_ev[key] = step
        if decision is not None:
            self._step_dec[key] = decision
        if key in self._step_ev and key in self._step_dec:
            self._export_step(key)
        while len(self._step_ev) > self._MAX_PENDING_STEPS:  # an older recording without decisions
            self._export_step(next(iter(self._step_ev)))
        while len(self._step_dec) > self._MAX_PENDING_STEPS:  # an idle step: a decision, no batch
            self._export_step(next(iter(self._step_dec)))

    def _export_step(self, key: tuple[str, int]) -> None:
        step = self._step_ev.pop(key, None)
        d = self._step_dec.pop(key, None)
        evicts = self._step_evicts.pop(key, [])
        attrs: dict[str, Any] = {"workbench.proc": key[0], "workbench.step": key[1]}
        times: list[int] = []
        if step is not None:
            times += [step.ts - int(step.forward_ms * 1e6), step.ts]
            attrs |= {
                "workbench.mode": step.mode,
                "workbench.batch_size": step.batch_size,
                "workbench.forward_ms": step.forward_ms,
                "workbench.reqs": [r.rid for r in step.reqs],
            }
        if d is not None:
            times += [t for t in (d.start_ts, d.ts) if t]
            attrs |= {f"workbench.{k}": v for k, v in decision_args(d).items()}
        if not times:
            return
        span = self.tracer.start_span("scheduler_step", start_time=self._wall(min(times)), attributes=attrs)
        for e in evicts:
            span.add_event(
                "cache.evict",
                {"workbench.tokens": e.tokens, "workbench.node_ids": list(e.node_ids)},
                timestamp=self._wall(e.ts),
            )
        if d is not None:
            for rid in d.retracted:
                span.add_event("retract", {"workbench.rid": rid}, timestamp=self._wall(d.ts))
        span.end(end_time=self._wall(max(times)))

    def flush_steps(self) -> None:
        """Export the steps still waiting for their other half (the end of a recording)."""
        with self._lock:
            for key in list(self._step_ev) + list(self._step_dec):
                self._export_step(key)

    def _wall(self, mono_ns: int) -> int:
        return int(mono_ns) + self._offset_ns

    def close(self) -> None:
        """Flush pending spans and stop the processor."""
        self.flush_steps()
        self.provider.force_flush()
        self.provider.shutdown()


def make_exporter(endpoint: str | None, model: str = "") -> OtelExporter | None:
    """The exporter for `--otlp-traces-endpoint` (None when no endpoint is given)."""
    if not endpoint:
        return None
    return OtelExporter(otlp_span_exporter(endpoint), model=model)
