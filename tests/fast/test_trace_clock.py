"""The trace's clock (core/trace/clock.py): the host's monotonic clock by default; a simulated
deployment's `SharedClock`, which stands still until moved, moves by exactly what it is told, runs at a
rate (stopping at an announced arrival), is held by an arriving request, and reads the same from
another process. A tracer stamps with whichever clock the process installed.

The end-to-end tests of this module are in tests/e2e/test_trace_clock_e2e.py.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from workbench.core.trace import clock as trace_clock
from workbench.core.trace import events as ev
from workbench.core.trace.tracer import Tracer


@pytest.fixture
def shared(tmp_path):
    c = trace_clock.SharedClock(str(tmp_path / "clock"), create=True)
    yield c
    c.close()


def test_a_fresh_clock_stands_still_and_moves_by_exactly_what_it_is_told(shared):
    t = shared.now_ns()
    assert not shared.running
    time.sleep(0.01)
    assert shared.now_ns() == t  # still: host time passing is not the deployment's
    assert shared.advance(13_415_268) == t + 13_415_268 == shared.now_ns()
    shared.jump_to(t)  # never backwards
    assert shared.now_ns() == t + 13_415_268
    shared.jump_to(t + 10**9)
    assert shared.now_ns() == t + 10**9 and not shared.running


def test_running_time_flows_at_its_rate_and_stops_at_an_announced_arrival(shared):
    t = shared.hold()
    w0 = time.monotonic_ns()
    shared.run(100.0)
    time.sleep(0.02)
    now, w1 = shared.now_ns(), time.monotonic_ns()
    assert shared.running and 100 * 0.02e9 <= now - t <= 100 * (w1 - w0)
    held = shared.hold()
    assert not shared.running and held >= now and shared.now_ns() == held
    shared.run(1000.0, until=held + 5_000_000)  # 5 ms of simulated time away: reached in 5 us
    time.sleep(0.01)
    assert shared.now_ns() == held + 5_000_000  # and there it waits for the request


def test_an_arriving_request_holds_the_clock_and_is_counted(tmp_path, shared):
    shared.run(1.0)
    other = trace_clock.SharedClock(shared.path)  # the tokenizer manager's view of the same file
    other.note_sent()
    assert not shared.running and shared.sent() == 1
    held = shared.now_ns()
    shared.run(1.0, received=0)  # the scheduler has not received it: time stays held
    assert not shared.running and shared.now_ns() == held
    shared.run(1.0, received=1)
    assert shared.running
    other.note_unsent()  # a bad request that was never sent
    assert shared.sent() == 0
    shared.hold()
    other.announce(shared.now_ns() + 12345)
    assert shared.announced() == shared.now_ns() + 12345
    other.announce(12345)  # in the past: announced as now (time never goes back for a reader)
    assert shared.announced() == shared.now_ns()
    other.announce(None)
    assert shared.announced() is None
    assert shared.announcer() == os.getpid()  # who announced: a scheduler tells a slow driver from a dead one
    other.close()


def test_an_announcement_is_waited_for_while_its_driver_lives_and_given_up_when_it_dies(shared):
    """A live simulated scheduler holds time for an announced arrival as long as its driver's process
    lives (a loaded host may take seconds to deliver it), and goes on at once when that process is gone."""
    import multiprocessing

    from workbench.core.simulation import live

    waiter = live.LiveSimClock(shared, 0.0, worker=None)
    due = shared.now_ns() + 1000
    shared.announce(due)
    assert not waiter._gave_up_on(due)
    waiter._waiting_for = (due, time.monotonic() - 2.0)  # two wall seconds without it: a slow driver, still waited for
    assert not waiter._gave_up_on(due)
    driver = multiprocessing.get_context("spawn").Process(target=_announce_and_die, args=(shared.path, due + 1))
    driver.start()
    driver.join(60)
    assert shared.announced() == due + 1 and shared.announcer() == driver.pid
    assert waiter._gave_up_on(due + 1)  # its driver is gone: the deployment goes on
    waiter._waiting_for = (due + 2, time.monotonic() - live.ANNOUNCE_WAIT_S - 1)
    shared.announce(due + 2)
    assert waiter._gave_up_on(due + 2)  # a live driver that hung past the bound is given up too


def _announce_and_die(path: str, due: int) -> None:
    trace_clock.SharedClock(path).announce(due)


def test_a_reader_never_sees_half_a_write(shared):
    base = shared.hold()
    stop, seen = threading.Event(), []

    def writer():
        while not stop.is_set():
            shared.advance(1000)
            shared.run(0.5)  # a write with a rate, then back to still
            shared.hold()

    th = threading.Thread(target=writer)
    th.start()
    try:
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            seen.append(shared.now_ns())
    finally:
        stop.set()
        th.join()
    assert seen == sorted(seen)  # never backwards, so never a torn (anchor, rate) pair
    assert seen[-1] - base >= 1000


def test_a_tracer_stamps_with_the_installed_clock(shared):
    got = []
    tracer = Tracer("scheduler", sink=got.extend, enabled=True)
    before = trace_clock.install(shared)
    try:
        shared.advance(5)
        tracer.emit(ev.ReqArrived(rid="a"))
        tracer.flush()
        assert got[0].ts == shared.now_ns() and trace_clock.now_ns() == shared.now_ns()
    finally:
        trace_clock.install(before)
    assert not trace_clock.current().simulated
    assert abs(trace_clock.now_ns() - time.monotonic_ns()) < 10**9


def test_data_parallel_replicas_keep_their_own_time_and_the_one_furthest_behind_goes_next(tmp_path):
    """Data parallel: each replica's time in its slot; the shared time is the earliest busy replica's
    and never goes back; only the busy replica furthest behind may start a pass; time runs (idle) only
    when no replica is busy; a pass's outputs are pending until the replica says it sent them, and
    until then no other replica may begin a pass."""
    c = trace_clock.SharedClock(str(tmp_path / "clock"), create=True, replicas=3)
    try:
        t = c.now_ns()
        assert c.replicas == 3 and c.all_idle() and not c.replica_turn(0)
        assert c.replica_begin(1, t) == t and c.replica_begin(0, t) == t
        assert c.replica_turn(0) and not c.replica_turn(1)  # a tie: the lowest rank
        assert c.replica_advance(0, 300) == t + 300 and c.outputs_of(0) is None  # pending until sent
        c.outputs_sent(0, 1)
        assert c.outputs_of(0) == 1
        assert c.now_ns() == t and c.replica_turn(1)  # replica 1 is behind now: shared time stays
        c.replica_advance(1, 100)
        # Its step is not done (outputs unsent, KV not noted): it may go on, no other replica may begin.
        assert c.now_ns() == t + 100 and c.replica_turn(1) and not c.replica_turn(0)
        c.replica_advance(1, 500)
        assert c.now_ns() == t + 300 and not c.replica_turn(0)
        c.outputs_sent(1, 2)
        assert c.replica_turn(0) and not c.replica_turn(1)
        assert trace_clock.ReplicaClock(c, 1).now_ns() == t + 600
        assert trace_clock.ReplicaClock(c, 2).now_ns() == t + 300  # an idle replica reads the shared time
        c.replica_begin(2, t + 50)  # a request that arrived at t+50 to an idle replica: its time, not now
        assert c.replica_turn(2) and c.now_ns() == t + 300  # behind the shared time, which never goes back
        c.replica_end(2)
        c.run(1.0)
        assert not c.running  # replicas are busy: time does not run
        c.replica_end(0)
        assert c.now_ns() == t + 600  # the only busy replica's
        c.jump_to(t + 10**9)
        assert c.now_ns() == t + 600
        c.replica_end(1)
        assert c.all_idle() and c.now_ns() == t + 600
        c.jump_to(t + 10**9)
        assert c.now_ns() == t + 10**9
        c.replica_begin(0, t)  # idle since t+300, but its last pass ended later than this arrival
        assert trace_clock.ReplicaClock(c, 0).now_ns() == t + 300
        c.set_received(0, 2)
        c.set_received(2, 1)
        assert c.received_total() == 3
        assert c.note_kv(0, 100) == 100 and c.note_kv(1, 50) == 150 and c.note_kv(0, 10) == 150
    finally:
        c.close()
