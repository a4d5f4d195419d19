"""Tracer -> TraceBus -> subscribers over real ZMQ sockets (ipc in a temp dir, tcp on 127.0.0.1)."""

from __future__ import annotations

import pathlib
import pickle
import shutil
import tempfile
import threading
import time

import pytest
import zmq
from synthetic import synthetic_trace
from workbench.core.trace import events as ev
from workbench.core.trace.bus import RemoteSubscription, TraceBus
from workbench.core.trace.state import TraceState
from workbench.core.trace.tracer import Tracer


def wait_for(cond, timeout=10.0, what="condition"):
    """Poll until cond() is truthy (a bound on waiting, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def collect(sub, n, timeout=10.0):
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        e = sub.get(timeout=0.05)
        if e is not None:
            out.append(e)
    return out


@pytest.fixture
def ipc_dir():
    d = tempfile.mkdtemp(prefix="wbt-", dir="/tmp")  # short: ipc paths are limited to ~100 chars
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def bus(ipc_dir):
    b = TraceBus(f"ipc://{ipc_dir}/trace")
    yield b
    b.close()


class Evil:
    """Unpickling this creates the file named by `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_tracer_over_ipc_delivers_in_order_and_stamped(bus):
    sub = bus.subscribe(name="test")
    tr = Tracer("scheduler", endpoint=bus.pull_endpoint, enabled=True)
    t_before = time.monotonic_ns()
    for step in range(5):
        tr.begin_step(step)
        for i in range(20):
            tr.emit(ev.ReqQueued(rid=f"r{step}-{i}", prompt_tokens=i, queue_len=i))
        tr.flush()
    got = collect(sub, 100)
    tr.close()
    assert [e.rid for e in got] == [f"r{s}-{i}" for s in range(5) for i in range(20)]
    assert all(e.proc == "scheduler" for e in got)
    assert [e.step for e in got] == [s for s in range(5) for _ in range(20)]
    ts = [e.ts for e in got]
    assert ts == sorted(ts) and ts[0] >= t_before
    assert bus.received_events == 100 and tr.sent_events == 100 and tr.dropped_total == 0
    # the bus folded them into its own state
    assert len(bus.state.requests) == 100


def test_disabled_tracer_is_silent_and_emit_keeps_explicit_stamps(bus):
    sub = bus.subscribe()
    tr = Tracer("detokenizer", endpoint=bus.pull_endpoint)  # off until enabled
    assert tr.enabled is False
    tr.emit(ev.ReqText(rid="x", delta="a"))
    tr.flush()
    tr.set_enabled(True)
    tr.emit(ev.ReqText(ts=42, proc="other", step=7, rid="y", delta="b"))
    tr.flush()
    got = collect(sub, 1)
    assert [(e.rid, e.ts, e.proc, e.step) for e in got] == [("y", 42, "other", 7)]
    assert sub.get(timeout=0.2) is None
    tr.close()


def test_slow_subscriber_loses_events_alone_and_is_told(bus):
    slow = bus.subscribe(maxsize=10, name="slow")
    fast = bus.subscribe(name="fast")
    tr = Tracer("scheduler", endpoint=bus.pull_endpoint, enabled=True)
    for b in range(10):
        for i in range(20):
            tr.emit(ev.ReqText(rid=f"r{b}", delta=str(i)))
        tr.flush()
    got = collect(fast, 200)
    assert len(got) == 200 and fast.dropped == 0
    assert len(slow) == 10 and slow.dropped == 190
    first = slow.drain()
    assert [e.delta for e in first] == [str(i) for i in range(10)]
    tr.emit(ev.ReqText(rid="late", delta="z"))
    tr.flush()
    late = collect(slow, 2)
    assert isinstance(late[0], ev.TraceDropped) and late[0].count == 190
    assert late[1].rid == "late"
    tr.close()


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_tracer_drops_when_bus_is_not_reading_and_reports_it(ipc_dir, zctx):
    pull = zctx.socket(zmq.PULL)  # a "bus" that is not reading
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.setsockopt(zmq.RCVBUF, 4096)
    pull.bind(f"ipc://{ipc_dir}/stuck")
    tr = Tracer("scheduler", endpoint=f"ipc://{ipc_dir}/stuck", enabled=True, sndhwm=1, flush_interval_s=None)
    try:
        emitted = 0
        for _ in range(2000):  # 64 KiB batches fill every buffer quickly
            tr.emit(ev.ReqText(rid="r", delta="x" * 65536))
            emitted += 1
            tr.flush()  # returns at once: a blocking send would hang here
            if tr.dropped_total >= 3:
                break
        dropped = tr.dropped_total
        assert dropped >= 3 and tr.sent_events == emitted - dropped
        received = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(received) < emitted - dropped:
            if pull.poll(50):
                received.extend(ev.decode_batch(pull.recv()))
        assert len(received) == emitted - dropped
        assert not any(isinstance(e, ev.TraceDropped) for e in received)
        # The bus reads again: the next batch that gets through reports the loss first.
        # (Stop at the first send that succeeds, not at the first poll that sees something: on a
        # busy machine a sent batch can take longer than one poll to arrive.)
        for i in range(200):
            sent = tr.sent_batches
            tr.emit(ev.ReqText(rid=f"after{i}", delta="ok"))
            tr.flush()
            if tr.sent_batches > sent:
                break
            time.sleep(0.05)
        assert pull.poll(30_000), "the batch that got through never arrived"
        batch = ev.decode_batch(pull.recv())
        assert isinstance(batch[0], ev.TraceDropped) and batch[0].proc == "scheduler"
        assert batch[0].count == tr.dropped_total >= dropped
        assert [e.rid for e in batch[1:]] == [f"after{i}"]
        assert not pull.poll(100)
    finally:
        tr.close()


def test_tracer_never_raises():
    calls = []

    def bad_sink(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("sink down")

    tr = Tracer("tokenizer", sink=bad_sink, enabled=True)
    tr.emit(ev.ReqArrived(rid="a"))
    tr.flush()  # swallowed, counted
    assert tr.dropped_total == 1
    got = []
    tr._sink = got.extend
    tr.emit(ev.ReqArrived(rid="b"))
    tr.flush()
    assert isinstance(got[0], ev.TraceDropped) and got[0].count == 1 and got[1].rid == "b"
    broken = Tracer("x", endpoint="not-an-endpoint", enabled=True)
    broken.emit(ev.ReqArrived(rid="c"))
    broken.flush()
    assert broken.dropped_total == 1
    broken.emit(None)  # garbage in: still no exception
    broken.close()


def test_in_process_sink_and_callbacks_run_on_the_bus_thread(bus):
    seen, threads = [], set()

    def cb(batch):
        threads.add(threading.current_thread().name)
        seen.extend(batch)

    bus.subscribe_callback(cb)
    tr = Tracer("tokenizer", sink=bus.publish_batch, enabled=True)
    tr.emit(ev.ReqArrived(rid="a", prompt_preview="hi"))
    tr.emit(ev.ReqTokenized(rid="a", prompt_tokens=3, max_new_tokens=4))
    tr.flush()
    wait_for(lambda: len(seen) == 2, what="callback")
    assert threads == {"trace-bus"}
    assert [e.proc for e in seen] == ["tokenizer", "tokenizer"]
    assert bus.state.requests["a"].prompt_tokens == 3


def test_failing_callback_is_removed_and_listeners_hook(bus):
    changes = []
    bus.on_listeners_changed = changes.append
    s1 = bus.subscribe()
    s2 = bus.subscribe()
    assert changes == [True] and bus.listener_count == 2
    s1.close()
    s2.close()
    assert changes == [True, False] and bus.listener_count == 0

    def boom(batch):
        raise ValueError("bad view")

    bus.subscribe_callback(boom)
    assert changes == [True, False, True]
    bus.publish_batch([ev.ReqArrived(ts=1, rid="a")])
    # The count drops before the hook runs (both on the bus thread): wait for the hook too.
    wait_for(lambda: bus.listener_count == 0 and len(changes) >= 4, what="callback removal")
    assert changes == [True, False, True, False]
    h = bus.subscribe_callback(lambda b: None)
    h.close()
    assert changes[-2:] == [True, False]


def test_late_subscriber_gets_a_snapshot(bus):
    keep = bus.subscribe()  # a listener, so the bus keeps state
    evs = synthetic_trace(n_requests=6, seed=2)
    half = len(evs) // 2
    bus.publish_batch(evs[:half])
    collect(keep, half)
    late = bus.subscribe(with_snapshot=True)
    snap = late.drain()
    assert any(isinstance(e, ev.ReqSnapshot) for e in snap)
    mirror = TraceState()
    mirror.apply_many(evs[:half])
    rebuilt = TraceState()
    rebuilt.apply_many(snap)
    assert rebuilt.dump()["requests"] == mirror.dump()["requests"]
    assert rebuilt.counters == mirror.counters
    bus.publish_batch(evs[half:])
    rebuilt.apply_many(collect(late, len(evs) - half))
    mirror.apply_many(evs[half:])
    assert rebuilt.dump()["requests"] == mirror.dump()["requests"]


def test_malicious_pickle_to_the_pull_endpoint_is_not_executed(bus, tmp_path, zctx):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Evil(str(marker)))
    probe = tmp_path / "probe"  # prove the payload is live when unpickled
    pickle.loads(pickle.dumps(Evil(str(probe))))
    assert probe.exists()
    sub = bus.subscribe()
    push = zctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(bus.pull_endpoint)
    push.send(payload)
    push.send(b"\x92\xc1")  # truncated/invalid msgpack too
    push.send(ev.encode_batch([ev.ReqArrived(ts=5, proc="x", rid="ok")]))
    got = collect(sub, 1)
    assert [e.rid for e in got] == ["ok"]  # the bus survived and kept going
    assert bus.malformed == 2
    assert not marker.exists()


def test_remote_subscription_over_tcp_and_listener_hook():
    b = TraceBus("tcp://127.0.0.1:*", publish_addr="tcp://127.0.0.1:*", model="smol")
    changes = []
    b.on_listeners_changed = changes.append
    remote = RemoteSubscription(b.publish_endpoint)
    try:
        # The count moves before the hook runs (both on the bus thread): wait for the hook too.
        wait_for(lambda: b.listener_count == 1 and changes, what="remote attach")
        assert changes == [True]
        head = remote.get(timeout=10)
        assert isinstance(head, ev.TraceHeader) and head.model == "smol"
        assert head.schema_version == ev.SCHEMA_VERSION
        tr = Tracer("scheduler", endpoint=b.pull_endpoint, enabled=True)
        for s in range(3):
            tr.begin_step(s)
            tr.emit(ev.BatchStep(mode="decode", reqs=[ev.StepReq("r", 0, 0, 1)], batch_size=1, padded_size=1))
            tr.flush()
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            e = remote.get(timeout=0.05)
            if isinstance(e, ev.BatchStep):
                got.append(e)
        assert [e.step for e in got] == [0, 1, 2] and all(e.proc == "scheduler" for e in got)
        assert remote.malformed == 0
        tr.close()
        remote.close()
        wait_for(lambda: b.listener_count == 0 and len(changes) >= 2, what="remote detach")
        assert changes == [True, False]
    finally:
        remote.close()
        b.close()


def test_remote_subscription_ignores_malicious_pickle(tmp_path, zctx):
    marker = tmp_path / "pwned"
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    good = ev.encode_batch([ev.ReqArrived(ts=1, rid="hello")])
    with RemoteSubscription(f"tcp://127.0.0.1:{port}") as remote:

        def joined():  # PUB/SUB: wait until the subscription took effect
            pub.send(good)
            return remote.get(timeout=0.02)

        wait_for(joined, what="SUB to join")
        pub.send(pickle.dumps(Evil(str(marker))))
        pub.send(ev.encode_batch([ev.ReqArrived(ts=2, rid="after")]))
        e = remote.get(timeout=30)
        while e is not None and e.rid == "hello":
            e = remote.get(timeout=30)
        assert e is not None and e.rid == "after"
        assert remote.malformed == 1 and not marker.exists()


def test_close_is_clean_and_wakes_waiters(ipc_dir):
    b = TraceBus(f"ipc://{ipc_dir}/t2")
    sub = b.subscribe()
    results = []
    t = threading.Thread(target=lambda: results.append(sub.get(timeout=None)))
    t.start()
    b.close()
    t.join(timeout=5)
    assert not t.is_alive() and results == [None]
    assert not b._thread.is_alive() and sub.closed
    b.close()  # idempotent
    b.publish_batch([ev.ReqArrived(rid="x")])  # ignored after close
