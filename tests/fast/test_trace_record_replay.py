"""Recorder -> load_trace -> TraceState, Replay's clock, and the Perfetto exporter."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import pytest
from reliability_helpers import wait_for
from synthetic import synthetic_trace
from trace_helpers import expected_chunks
from workbench.core.trace import events as ev
from workbench.core.trace.bus import TraceBus
from workbench.core.trace.perfetto import export_perfetto
from workbench.core.trace.recorder import Recorder, TraceFormatError, load_trace, read_trace
from workbench.core.trace.replay import Replay
from workbench.core.trace.state import TraceState
from workbench.core.trace.tracer import Tracer


def fold(events) -> TraceState:
    st = TraceState()
    st.apply_many(events)
    return st


@pytest.fixture(scope="module")
def trace_events():
    return synthetic_trace(n_requests=10, seed=7)


def test_recorder_on_a_live_bus_matches_the_live_state(tmp_path, trace_events):
    d = tempfile.mkdtemp(prefix="wbt-", dir="/tmp")
    bus = TraceBus(f"ipc://{d}/trace")
    try:
        rec = Recorder(tmp_path / "run.jsonl", model="smol")
        handle = bus.subscribe_callback(rec)
        sub = bus.subscribe()
        tr = Tracer("scheduler", endpoint=bus.pull_endpoint, enabled=True)
        live = TraceState()
        n = 0
        for e in trace_events:  # re-emit through a real tracer, step by step
            tr.begin_step(e.step)
            tr.emit(msgspec_copy(e))
            if isinstance(e, ev.BatchStep):
                tr.flush()
        tr.flush()
        deadline = time.monotonic() + 10
        while n < len(trace_events) and time.monotonic() < deadline:
            got = sub.get(timeout=0.05)
            if got is not None:
                live.apply(got)
                n += 1
        assert n == len(trace_events)
        # The bus calls the recorder after offering a batch to subscriptions (and outside its
        # lock): closing it as soon as the subscription has everything could lose the last batch.
        wait_for(lambda: rec.events_written >= len(trace_events), 30, "the recorder to write every event")
        tr.close()
        handle.close()
        rec.close()
        header, loaded = read_trace(tmp_path / "run.jsonl")
        assert header.model == "smol" and header.schema_version == ev.SCHEMA_VERSION
        assert len(loaded) == len(trace_events) == rec.events_written
        assert fold(loaded).dump() == live.dump()
        assert live.dump()["counters"]["num_requests_total"] == 10
    finally:
        bus.close()
        shutil.rmtree(d, ignore_errors=True)


def msgspec_copy(e):
    return ev.decode_json(ev.encode_json(e))


def test_gzip_roundtrip_and_truncated_last_line(tmp_path, trace_events):
    with Recorder(tmp_path / "run.jsonl.gz") as rec:
        rec.write_batch(trace_events)
    assert fold(load_trace(tmp_path / "run.jsonl.gz")).dump() == fold(trace_events).dump()
    p = tmp_path / "cut.jsonl"
    with Recorder(p) as rec:
        rec.write_batch(trace_events[:20])
    data = p.read_bytes()
    p.write_bytes(data[:-15])  # the recorder died mid-line
    assert len(load_trace(p)) == 19


def test_load_trace_refuses_non_traces_and_newer_schemas(tmp_path):
    (tmp_path / "notes.txt").write_text("hello\nworld\n")
    with pytest.raises(TraceFormatError, match="not a workbench trace"):
        load_trace(tmp_path / "notes.txt")
    (tmp_path / "other.jsonl").write_text('{"kind": "something"}\n')
    with pytest.raises(TraceFormatError, match="no trace.header"):
        load_trace(tmp_path / "other.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TraceFormatError, match="empty"):
        load_trace(tmp_path / "empty.jsonl")
    newer = ev.SCHEMA_VERSION + 1
    (tmp_path / "new.jsonl").write_text(json.dumps({"kind": "trace.header", "schema_version": newer}) + "\n")
    with pytest.raises(TraceFormatError, match=f"schema v{newer}.*upgrade"):
        load_trace(tmp_path / "new.jsonl")
    good = ev.encode_json(ev.TraceHeader(ts=1)).decode()
    (tmp_path / "bad.jsonl").write_text(good + '\n{"kind": "req.nope", "ts": 1}\n' + good + "\n")
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:2"):
        load_trace(tmp_path / "bad.jsonl")
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_replay_step_releases_through_each_batch_step(trace_events):
    r = Replay(trace_events)
    n_steps = sum(isinstance(e, ev.BatchStep) for e in trace_events)
    assert r.drain() == [] and not r.done  # nothing before the consumer moves the clock
    chunks = []
    while not r.done:
        released = r.step()
        assert r.drain() == released
        chunks.append(released)
    assert all(isinstance(c[-1], ev.BatchStep) for c in chunks[:n_steps])
    assert sum(len(c) for c in chunks) == len(trace_events)
    assert len(chunks) in (n_steps, n_steps + 1)  # + the tail after the last step
    assert [e for c in chunks for e in c] == trace_events
    assert r.step() == [] and r.position_ns == r.end_ns


def test_replay_advance_to_and_backward_seek(trace_events):
    r = Replay(trace_events)
    assert r.duration_ns == r.end_ns - r.start_ns > 0
    mid = r.start_ns + r.duration_ns // 2
    released = r.advance_to(mid)
    assert released and max(e.ts for e in released) <= mid
    nxt = trace_events[len(released)]
    assert nxt.ts > mid or any(e.ts > nxt.ts for e in released)  # the next one is not due yet
    assert r.advance_to(mid) == [] and r.advance_to(mid - 10) == []  # forward only
    consumer = TraceState()
    consumer.apply_many(r.drain())
    assert consumer.dump() == r.state_at(mid).dump() == fold(released).dump()
    r.advance_to(r.end_ns)
    consumer.apply_many(r.drain())
    assert r.done and consumer.dump() == fold(trace_events).dump()
    quarter = r.start_ns + r.duration_ns // 4
    epoch = r.epoch
    r.seek(quarter)  # backward: reset + replay up to quarter
    assert r.epoch == epoch + 1 and not r.done
    consumer.apply_many(r.drain())
    assert consumer.dump() == r.state_at(quarter).dump()
    assert consumer.dump() != fold(trace_events).dump()


class FakeClock:
    def __init__(self, now: int = 10**15):
        self.now = now

    def __call__(self) -> int:
        return self.now


def test_replay_follows_a_consumer_wall_clock_at_speed(tmp_path, trace_events):
    p = tmp_path / "t.jsonl"
    with Recorder(p, model="m") as rec:
        rec.write_batch(trace_events)
    clock = FakeClock()
    r = Replay(p, speed=2.0, max_idle_s=None, clock=clock)
    assert r.header.model == "m"
    clock.now += 10**9
    assert r.advance() == [] and r.drain() == []  # paused: the clock does not move
    r.play()
    clock.now += 50_000_000  # 50 ms of wall time at 2x = 100 ms of trace
    r.advance()
    assert r.position_ns == r.start_ns + 100_000_000
    clock.now += 50_000_000
    r.set_speed(1.0)  # +100 ms of trace at the old speed
    assert r.position_ns == r.start_ns + 200_000_000
    clock.now += 50_000_000
    got = r.drain()  # drain moves a playing clock too
    assert r.position_ns == r.start_ns + 250_000_000
    r.pause()
    clock.now += 10**12
    assert r.drain() == [] and r.position_ns == r.start_ns + 250_000_000
    assert got[0] is r.header  # a recording plays its header first
    assert got[1:] == trace_events[: len(got) - 1] and max(e.ts for e in got[1:]) <= r.position_ns
    assert r.get(timeout=None) is None  # paused and nothing due: no waiting


def test_replay_skips_idle_gaps_while_playing():
    evs = [ev.ReqArrived(ts=1_000, rid="a"), ev.ReqArrived(ts=60 * 10**9, rid="b")]
    clock = FakeClock(0)
    r = Replay(evs, max_idle_s=1.0, clock=clock)
    r.play()
    clock.now += 1
    assert [e.rid for e in r.drain()] == ["a"]
    clock.now += 1
    assert [e.rid for e in r.drain()] == ["b"]  # 60 s of nothing skipped
    assert r.done


def test_replay_run_realtime(trace_events):
    short = [e for e in trace_events if e.ts <= trace_events[0].ts + 30_000_000]
    got = []
    Replay(short, speed=1000.0).run_realtime(got.extend, tick_s=0.001)
    assert got == short


def test_perfetto_export_is_valid_trace_event_json(tmp_path, trace_events):
    out = tmp_path / "trace.json"
    export_perfetto(trace_events, out)
    doc = json.loads(out.read_text())
    assert doc["displayTimeUnit"] == "ms"
    tev = doc["traceEvents"]
    for e in tev:
        assert {"name", "ph", "ts", "pid", "tid"} <= e.keys(), e
        assert e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] in ("b", "e", "n"):
            assert "id" in e and e["cat"] == "request"
        if e["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values())
    rids = {e.rid for e in trace_events if hasattr(e, "rid")}
    assert sorted(e["id"] for e in tev if e["ph"] == "b" and e["name"] == "request") == sorted(rids)
    n_steps = sum(isinstance(e, ev.BatchStep) for e in trace_events)
    assert sum(1 for e in tev if e["ph"] == "X" and e["cat"] == "step") == n_steps
    names = {e["args"]["name"] for e in tev if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"requests", "scheduler", "tokenizer", "detokenizer"} <= names
    # Async slices nest properly per request: b/e pair up like parentheses, in time order.
    by_id: dict[str, list] = {}
    for e in tev:
        if e["ph"] in ("b", "e"):
            by_id.setdefault(e["id"], []).append(e)
    for rid, seq in by_id.items():
        stack, last_ts = [], -1.0
        for e in seq:
            assert e["ts"] >= last_ts, rid
            last_ts = e["ts"]
            if e["ph"] == "b":
                stack.append(e["name"])
            else:
                assert stack.pop() == e["name"], rid
        assert not stack
        stages = [e["name"] for e in seq if e["ph"] == "b" and e["name"] != "chunked_prefill"]
        assert stages == ["request", "prefill_waiting", "prefill_forward", "decode_loop"], (rid, stages)
    counters = {e["name"] for e in tev if e["ph"] == "C"}
    assert {"queue", "kv_tokens", "tokens"} <= counters


def test_perfetto_empty_and_unfinished(tmp_path):
    assert export_perfetto([], tmp_path / "empty.json") == {"traceEvents": [], "displayTimeUnit": "ms"}
    doc = export_perfetto(
        [
            ev.ReqArrived(ts=10, proc="tokenizer", rid="x"),
            ev.ReqQueued(ts=20, proc="scheduler", rid="x", prompt_tokens=3, queue_len=1),
        ],
        tmp_path / "one.json",
    )
    slices = [(e["ph"], e["name"], e["ts"]) for e in doc["traceEvents"] if e["ph"] in "be"]
    assert slices == [
        ("b", "request", 0.0),
        ("b", "prefill_waiting", 0.01),
        ("e", "prefill_waiting", 0.01),
        ("e", "request", 0.01),
    ]


TOUR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tour_trace.jsonl")


def test_perfetto_export_of_a_real_recording_has_one_slice_per_chunk_and_the_decisions(tmp_path):
    """A real recording (the guided tour: chunked prefills, evictions, a retraction): each chunk of a
    chunked prefill is its own slice with its token range, each step slice carries its decision
    (admitted, reasons, KV + and -, held slots) and evictions and retractions are instants."""
    _, events = read_trace(TOUR)
    doc = json.loads(json.dumps(export_perfetto(events, tmp_path / "tour.json")))
    tev = doc["traceEvents"]
    want = expected_chunks(events)  # from the scheduler's req.scheduled events
    assert len(want) >= 2 and all(len(v) >= 2 for v in want.values()), want
    got: dict[str, list[tuple[int, int, int]]] = {}
    for e in tev:
        if e["ph"] == "b" and e["name"] == "chunked_prefill":
            a = e["args"]
            got.setdefault(e["id"], []).append((a["chunk_index"], a["token_start"], a["token_end"]))
    assert got == want
    # Every request's async slices still nest in time order (a retracted request included).
    for rid in {x["id"] for x in tev if x["ph"] == "b"}:
        stack, last = [], -1.0
        for x in (x for x in tev if x["ph"] in "be" and x["id"] == rid):
            assert x["ts"] >= last, rid
            last = x["ts"]
            if x["ph"] == "b":
                stack.append(x["name"])
            else:
                assert stack.pop() == x["name"], rid
    # Each chunk slice lies inside its request's prefill_forward slice.
    for rid in want:
        seq = [(x["ph"], x["name"]) for x in tev if x.get("id") == rid and x["ph"] in "be"]
        i, j = seq.index(("b", "prefill_forward")), seq.index(("e", "prefill_forward"))
        assert [n for ph, n in seq[i:j] if ph == "b"].count("chunked_prefill") == len(want[rid])
    # Step slices carry their step's decision.
    decisions = {d.step: d for d in events if isinstance(d, ev.StepDecision)}
    steps = [x for x in tev if x["ph"] == "X" and x["cat"] == "step"]
    assert steps and all(x["args"]["step"] in decisions for x in steps)
    for x in steps:
        d, a = decisions[x["args"]["step"]], x["args"]
        assert a["admitted"] == d.admitted and a["stop_reason"] == d.stop_reason and a["stop_rid"] == d.stop_rid
        assert (a["kv_plus"], a["kv_minus"], a["kv_held"]) == (d.kv_alloc, d.kv_freed, d.kv_held)
        assert f"KV +{d.kv_alloc} −{d.kv_freed}" in a["decision"]
        assert all(rid in a["decision"] for rid in d.admitted)
    assert any(x["args"]["stop_reason"] == "kv" and "KV room" in x["args"]["decision"] for x in steps)
    assert any(x["args"]["released"] for x in steps)
    # Evictions and retractions are instants on the scheduler's track.
    evicts = [e for e in events if isinstance(e, ev.CacheEvict)]
    inst = [x for x in tev if x["ph"] == "i" and x["name"] == "cache.evict"]
    assert evicts and [(x["args"]["step"], x["args"]["tokens"]) for x in inst] == [(e.step, e.tokens) for e in evicts]
    retracted = [e.rid for e in events if isinstance(e, ev.ReqRetracted)]
    assert retracted and [x["args"]["rid"] for x in tev if x["ph"] == "i" and x["name"] == "retract"] == retracted


def test_replay_of_a_recording_keeps_its_header_across_seeks(tmp_path, trace_events):
    p = tmp_path / "t.jsonl"
    with Recorder(p, model="m") as rec:
        rec.write_batch(trace_events)
    r = Replay(p)
    consumer = TraceState()
    r.advance_to(r.end_ns)
    consumer.apply_many(r.drain())
    assert consumer.model == "m" and "recorder" not in consumer.procs
    r.seek(r.start_ns)
    consumer.apply_many(r.drain())
    assert consumer.model == "m" and consumer.requests == {}


def test_trace_export_reports_events_read_and_trace_events_written(tmp_path, capsys):
    from tui_helpers import FIXTURE

    from workbench.cli import main

    out = tmp_path / "t.json"
    assert main(["trace", "export", FIXTURE, "--perfetto", str(out)]) == 0
    said = capsys.readouterr().out
    read, written = len(load_trace(FIXTURE)), len(json.loads(out.read_text())["traceEvents"])
    assert read != written  # two different counts, each named for what it counts
    assert f"read {read} workbench events from {FIXTURE}" in said
    assert f"wrote {written} Perfetto trace events to {out}" in said


def _with_startup(gap_s: float = 40.0) -> list:
    """An engine's start-up (processes, empty queues and KV), `gap_s` of model loading, then one
    request served in one step."""
    t, s, ms = 10**12, 10**9, 10**6
    a = t + int(gap_s * s)
    return [
        ev.ProcStarted(ts=t, proc="scheduler", pid=1, role="scheduler"),
        ev.KVUsage(ts=t + 1, proc="scheduler", used=0, evictable=0, free=100, total=100),
        ev.ReqArrived(ts=a, proc="tokenizer", rid="x"),
        ev.BatchStep(
            ts=a + 100 * ms,
            proc="scheduler",
            step=0,
            mode="extend",
            batch_size=1,
            padded_size=1,
            reqs=[ev.StepReq("x", 0, 4, 1)],
        ),
        ev.ReqFinished(
            ts=a + 1000 * ms,
            proc="tokenizer",
            rid="x",
            reason="length",
            prompt_tokens=4,
            completion_tokens=1,
            cached_tokens=0,
            ttft=0.1,
            tpot=0.0,
            e2e=1.0,
        ),
    ]


def test_replay_clock_starts_at_the_first_request_not_at_engine_start_up():
    from workbench.tui.controller import ReplayController

    events = _with_startup()
    r = Replay(events)
    assert r.start_ns == events[0].ts and r.origin_ns == events[2].ts
    ctl = ReplayController(r, autoplay=False)
    assert ctl.origin_ns == r.origin_ns
    ctl.start(lambda msg: None)
    # start-up is shown at once, the clock reads 0 of the 1.1 s that follow the first request
    assert [type(e) for e in r.drain()] == [ev.ProcStarted, ev.KVUsage]
    assert " · 0.00/1.00 s · " in ctl.status()
    assert ctl.step() == 0
    assert " · 0.10/1.00 s · " in ctl.status()
    ctl.seek_end()
    assert " · 1.00/1.00 s · " in ctl.status()
    r.drain()
    ctl.restart()  # back to just before the first request
    assert [type(e) for e in r.drain()] == [ev.TraceReset, ev.ProcStarted, ev.KVUsage]
    assert " · 0.00/1.00 s · " in ctl.status()
    # a recording with no start-up keeps its first event as the zero
    plain = Replay(events[2:])
    assert plain.origin_ns == plain.start_ns


def test_replay_clock_skips_start_up_while_playing():
    from workbench.tui.controller import ReplayController

    clock = FakeClock(0)
    r = Replay(_with_startup(gap_s=1.5), clock=clock)  # a gap too short for max_idle_s to skip
    ctl = ReplayController(r, autoplay=True)
    ctl.start(lambda msg: None)
    r.drain()
    clock.now += 50 * 10**6
    got = r.drain()
    assert [type(e) for e in got] == [ev.ReqArrived]  # 50 ms in: the request, not more start-up
    assert " · 0.05/1.00 s · " in ctl.status()


def test_the_tui_counts_a_replays_event_times_from_its_first_request():
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import ReplayController
    from workbench.tui.panels.events import format_line

    events = _with_startup()
    app = WorkbenchApp(ReplayController(Replay(events), autoplay=False))
    assert app.model.t0_ns == events[2].ts
    app.model.apply(events)
    times = {ln.category: format_line(ln, app.model).plain.split("s ", 1)[0].strip() for ln in app.model.log.lines}
    assert times == {"proc": "-40.000", "arrive": "0.000", "finish": "1.000"}
