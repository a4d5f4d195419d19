"""OpenTelemetry export: one trace per request, with a span per stage.

A bus callback (like the Recorder) that folds events into its own `TraceState` and, when a
request ends, turns its `RequestView` into spans:

    request <rid>                arrival .. finish     prompt/completion/cached tokens, TTFT, TPOT, reason
      ├─ queue                   queued .. first prefill chunk
      ├─ prefill                 first prefill chunk .. first token      (one span event per chunk)
      └─ decode                  first token .. finish                   (retractions as span events)

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
    """

    def __init__(self, span_exporter, service_name: str = "serving-workbench", model: str = "", batch: bool = True):
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

    def __call__(self, batch: list[ev.Event]) -> None:
        ended = []
        with self._lock:
            for e in batch:
                self.state.apply(e)
                if isinstance(e, (ev.ReqFinished, ev.ReqAborted)):
                    ended.append(e.rid)
            for rid in dict.fromkeys(ended):
                view = self.state.requests.get(rid)
                if view is not None and view.done:
                    self.export_request(view)

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
        self._child("queue", ctx, r.queued_ts or start, first_prefill or end)
        if first_prefill is not None:
            span = self.tracer.start_span(
                "prefill",
                context=ctx,
                start_time=self._wall(first_prefill),
                attributes={"workbench.chunks": len(prefill)},
            )
            for t in prefill:
                span.add_event("chunk", {"detail": t.detail}, timestamp=self._wall(t.ts))
            span.end(end_time=self._wall(r.first_token_ts or end))
        if r.first_token_ts is not None:
            span = self.tracer.start_span(
                "decode",
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

    def _child(self, name: str, ctx, start_ns: int, end_ns: int) -> None:
        span = self.tracer.start_span(name, context=ctx, start_time=self._wall(start_ns))
        span.end(end_time=self._wall(max(start_ns, end_ns)))

    def _wall(self, mono_ns: int) -> int:
        return int(mono_ns) + self._offset_ns

    def close(self) -> None:
        """Flush pending spans and stop the processor."""
        self.provider.force_flush()
        self.provider.shutdown()


def make_exporter(endpoint: str | None, model: str = "") -> OtelExporter | None:
    """The exporter for `--otlp-traces-endpoint` (None when no endpoint is given)."""
    if not endpoint:
        return None
    return OtelExporter(otlp_span_exporter(endpoint), model=model)
