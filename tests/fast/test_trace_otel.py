"""OpenTelemetry export: spans per request stage, from hand-written events and from the real pipeline.

The end-to-end tests of this module are in tests/e2e/test_trace_otel_e2e.py.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402
from trace_helpers import expected_chunks  # noqa: E402
from workbench.core.trace import events as ev  # noqa: E402
from workbench.core.trace.otel import OtelExporter  # noqa: E402
from workbench.core.trace.recorder import read_trace  # noqa: E402

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
    assert set(spans) == {"request r1", "prefill_waiting", "prefill_forward", "decode_loop"}
    root = spans["request r1"]
    for child in ("prefill_waiting", "prefill_forward", "decode_loop"):
        assert spans[child].parent.span_id == root.context.span_id
        assert spans[child].context.trace_id == root.context.trace_id
    off = exp._offset_ns
    assert (root.start_time, root.end_time) == (t0 + off, t0 + 110 * MS + off)
    assert (spans["prefill_waiting"].start_time, spans["prefill_waiting"].end_time) == (
        t0 + 2 * MS + off,
        t0 + 10 * MS + off,
    )
    assert (spans["prefill_forward"].start_time, spans["prefill_forward"].end_time) == (
        t0 + 10 * MS + off,
        t0 + 40 * MS + off,
    )
    assert spans["prefill_forward"].attributes["workbench.chunks"] == 2
    assert (spans["decode_loop"].start_time, spans["decode_loop"].end_time) == (t0 + 40 * MS + off, t0 + 110 * MS + off)
    a = root.attributes
    assert a["gen_ai.usage.input_tokens"] == 100 and a["gen_ai.usage.output_tokens"] == 8
    assert a["workbench.finish_reason"] == "length" and a["workbench.ttft_s"] == pytest.approx(0.040)
    assert root.status.status_code != StatusCode.ERROR


def test_an_aborted_request_is_an_error_span_without_a_decode_stage():
    mem = InMemorySpanExporter()
    exp = OtelExporter(mem, batch=False)
    exp(_request_events("gone", 7_000 * MS, chunks=1, aborted=True))
    spans = _by_name(mem.get_finished_spans())
    assert "decode_loop" not in spans
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


TOUR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tour_trace.jsonl")


def test_a_real_recording_exports_one_span_per_chunk_and_the_decisions():
    """The guided tour's recording (chunked prefills, evictions, a retraction) through the exporter,
    in bus-sized batches: a chunked prefill is one chunked_prefill span per chunk with its token
    range, requests carry their admission and waiting reasons, and each scheduler step is a span with
    its decision (admitted, reasons, KV + and -, held slots) and its evictions as events."""
    _, events = read_trace(TOUR)
    mem = InMemorySpanExporter()
    exp = OtelExporter(mem, batch=False, steps=True)
    for i in range(0, len(events), 7):
        exp(events[i : i + 7])
    exp.close()
    spans = mem.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}

    def root_rid(s):
        while s.parent is not None:
            s = by_id[s.parent.span_id]
        return s.attributes.get("workbench.rid")

    want = expected_chunks(events)  # from the scheduler's req.scheduled events
    assert len(want) >= 2 and all(len(v) >= 2 for v in want.values()), want
    got: dict[str, list[tuple[int, int, int]]] = {}
    for s in spans:
        if s.name == "chunked_prefill":
            assert by_id[s.parent.span_id].name == "prefill_forward"
            a = s.attributes
            got.setdefault(root_rid(s), []).append(
                (a["workbench.chunk_index"], a["workbench.token_start"], a["workbench.token_end"])
            )
    assert {k: sorted(v) for k, v in got.items()} == want
    # Each request's admission is an event on its root span, with the step's KV + and -.
    decisions = [d for d in events if isinstance(d, ev.StepDecision)]
    roots = {s.attributes["workbench.rid"]: s for s in spans if s.name.startswith("request ")}
    for d in decisions:
        for rid in d.admitted:
            adm = [x for x in roots[rid].events if x.name == "admitted"]
            assert any(x.attributes["workbench.step"] == d.step for x in adm), (rid, d.step)
            x = next(x for x in adm if x.attributes["workbench.step"] == d.step)
            assert (x.attributes["workbench.kv_plus"], x.attributes["workbench.kv_minus"]) == (d.kv_alloc, d.kv_freed)
    # Why a request waited: the reason on its prefill_waiting span.
    kv_stop = next(d for d in decisions if d.stop_reason == "kv")
    waits = [
        x
        for s in spans
        if s.name == "prefill_waiting" and root_rid(s) == kv_stop.stop_rid
        for x in s.events
        if x.name == "waiting"
    ]
    assert any(x.attributes["workbench.reason"] == "kv" for x in waits), waits
    # One scheduler_step span per decision, carrying it; evictions and retractions as its events.
    steps = {s.attributes["workbench.step"]: s for s in spans if s.name == "scheduler_step"}
    assert set(steps) == {d.step for d in decisions}
    for d in decisions:
        a = steps[d.step].attributes
        assert list(a["workbench.admitted"]) == d.admitted and a["workbench.stop_reason"] == d.stop_reason
        assert (a["workbench.kv_plus"], a["workbench.kv_minus"], a["workbench.kv_held"]) == (
            d.kv_alloc,
            d.kv_freed,
            d.kv_held,
        )
    evicts = [e for e in events if isinstance(e, ev.CacheEvict)]
    assert evicts
    for e in evicts:
        x = [x for x in steps[e.step].events if x.name == "cache.evict"]
        assert [y.attributes["workbench.tokens"] for y in x] == [e.tokens]
    retracted = [e for e in events if isinstance(e, ev.ReqRetracted)]
    assert retracted and all(
        any(x.name == "retract" and x.attributes["workbench.rid"] == r.rid for x in steps[r.step].events)
        for r in retracted
    )
