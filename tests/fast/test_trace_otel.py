"""OpenTelemetry export: spans per request stage, from hand-written events and from the real pipeline.

The end-to-end tests of this module are in tests/e2e/test_trace_otel_e2e.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402
from workbench.core.trace import events as ev  # noqa: E402
from workbench.core.trace.otel import OtelExporter  # noqa: E402

MS = 1_000_000


def _request_events(rid: str, t0: int, chunks: int = 2, aborted: bool = False) -> list[ev.Event]:
    out = [
        ev.ReqArrived(ts=t0, proc="tokenizer", rid=rid, prompt_preview="hi"),
        ev.ReqTokenized(ts=t0 + 1 * MS, proc="tokenizer", rid=rid, prompt_tokens=100, max_new_tokens=8),
        ev.ReqQueued(ts=t0 + 2 * MS, proc="scheduler", rid=rid, prompt_tokens=100, queue_len=1),
    ]
    for k in range(chunks):
        out.append(
            ev.ReqScheduled(
                ts=t0 + (10 + 10 * k) * MS,
                proc="scheduler",
                rid=rid,
                prefix_hit=0,
                extend_len=50,
                chunk_index=k,
                num_chunks=chunks,
            )
        )
    if aborted:
        return out + [ev.ReqAborted(ts=t0 + 40 * MS, proc="scheduler", rid=rid, reason="client went away")]
    return out + [
        ev.ReqFirstToken(ts=t0 + 40 * MS, proc="scheduler", rid=rid),
        ev.ReqFinished(
            ts=t0 + 110 * MS,
            proc="scheduler",
            rid=rid,
            reason="length",
            prompt_tokens=100,
            completion_tokens=8,
            cached_tokens=0,
            ttft=0.040,
            tpot=0.010,
            e2e=0.110,
        ),
    ]


def _by_name(spans):
    return {s.name: s for s in spans}


def test_a_finished_request_becomes_a_root_span_with_three_stages():
    mem = InMemorySpanExporter()
    exp = OtelExporter(mem, model="m", batch=False)
    t0 = 5_000 * MS
    exp(_request_events("r1", t0)[:4])  # delivered in two batches, as the bus does
    assert mem.get_finished_spans() == ()  # nothing until the request ends
    exp(_request_events("r1", t0)[4:])
    spans = _by_name(mem.get_finished_spans())
    assert set(spans) == {"request r1", "queue", "prefill", "decode"}
    root = spans["request r1"]
    for child in ("queue", "prefill", "decode"):
        assert spans[child].parent.span_id == root.context.span_id
        assert spans[child].context.trace_id == root.context.trace_id
    off = exp._offset_ns
    assert (root.start_time, root.end_time) == (t0 + off, t0 + 110 * MS + off)
    assert (spans["queue"].start_time, spans["queue"].end_time) == (t0 + 2 * MS + off, t0 + 10 * MS + off)
    assert (spans["prefill"].start_time, spans["prefill"].end_time) == (t0 + 10 * MS + off, t0 + 40 * MS + off)
    assert [e.name for e in spans["prefill"].events] == ["chunk", "chunk"]
    assert (spans["decode"].start_time, spans["decode"].end_time) == (t0 + 40 * MS + off, t0 + 110 * MS + off)
    a = root.attributes
    assert a["gen_ai.usage.input_tokens"] == 100 and a["gen_ai.usage.output_tokens"] == 8
    assert a["workbench.finish_reason"] == "length" and a["workbench.ttft_s"] == pytest.approx(0.040)
    assert root.status.status_code != StatusCode.ERROR


def test_an_aborted_request_is_an_error_span_without_a_decode_stage():
    mem = InMemorySpanExporter()
    exp = OtelExporter(mem, batch=False)
    exp(_request_events("gone", 7_000 * MS, chunks=1, aborted=True))
    spans = _by_name(mem.get_finished_spans())
    assert "decode" not in spans
    assert spans["request gone"].status.status_code == StatusCode.ERROR


def test_missing_exporter_package_is_a_clear_error(monkeypatch):
    import builtins

    from workbench.core.trace import otel

    real_import = builtins.__import__

    def no_otlp(name, *a, **k):
        if name.startswith("opentelemetry.exporter.otlp"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_otlp)
    with pytest.raises(ValueError, match="pip install"):
        otel.otlp_span_exporter("http://127.0.0.1:4318/v1/traces")
