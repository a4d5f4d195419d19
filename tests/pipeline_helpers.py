"""Helpers shared by the pipeline tests: the KV leak check, trace collection, an in-process server."""

from __future__ import annotations

import contextlib
import time


def assert_no_kv_leak(engine, timeout: float = 20.0) -> dict:
    """Once idle and the cache flushed, every KV slot and request row must be free again.

    With the scheduler's KV integrity check on (tests/conftest.py sets WORKBENCH_KV_INVARIANT_CHECK=1
    for every engine the tests start), an idle scheduler also checks slot by slot, row by row and
    lock by lock (Scheduler.check_kv_invariants) and reports any violation here."""
    deadline = time.monotonic() + timeout
    while True:
        state = engine.get_internal_state()
        idle = state["num_waiting"] == 0 and state["num_running"] == 0
        if idle:
            assert not state.get("kv_check_error"), f"scheduler KV check: {state['kv_check_error']}"
            # Before the flush (which clears the pools): every slot is free or held by the cache.
            assert state["kv_free"] + state["kv_evictable"] == state["kv_total"], f"KV slots leaked: {state}"
            assert state["req_slots_free"] == state["req_slots_total"], f"request rows leaked: {state}"
        if idle and engine.flush_cache():
            state = engine.get_internal_state()
            break
        assert time.monotonic() < deadline, f"engine did not go idle: {state}"
        time.sleep(0.05)
    assert state["kv_free"] == state["kv_total"], f"KV slots leaked: {state}"
    assert state["req_slots_free"] == state["req_slots_total"], f"request rows leaked: {state}"
    return state


def drain_events(sub, settle: float = 0.3, until=None, timeout: float = 30.0) -> list:
    """Everything a subscription has received, waiting until the stream is quiet (bus.drain_settled)."""
    from workbench.core.trace.bus import drain_settled

    return drain_settled(sub, settle, until, timeout)


def generate_traced(engine, input_ids, sampling_params) -> tuple[list, list]:
    """(outputs, trace events) of one `generate` on `engine`, subscribed for its duration."""
    sub = engine.subscribe(with_snapshot=False)
    try:
        outs = engine.generate(input_ids=input_ids, sampling_params=sampling_params)
        events = drain_events(sub)
    finally:
        sub.close()
    return outs, events


def assert_routing_counts_real_tokens(events, top_k: int) -> None:
    """Every `moe.routing` event counts top_k assignments per token of its own step, in every sparse
    layer: the step's real tokens, never a CUDA-graph bucket's padding rows."""
    from workbench.core.trace import events as ev

    steps = {(e.proc, e.step): e for e in events if isinstance(e, ev.BatchStep)}
    routes = [e for e in events if isinstance(e, ev.MoeRouting)]
    assert routes
    for r in routes:
        tokens = sum(s.decode or s.computed for s in steps[(r.proc, r.step)].reqs)
        assert all(sum(row) == top_k * tokens for row in r.counts), (r.step, tokens, r.counts)


def expert_totals(events) -> list[list[int]]:
    """Tokens per expert per sparse layer over a run: equal for two runs of the same prompts however
    their steps were batched."""
    from workbench.core.trace import events as ev

    counts = [e.counts for e in events if isinstance(e, ev.MoeRouting)]
    return [[sum(c[i][x] for c in counts) for x in range(len(counts[0][i]))] for i in range(len(counts[0]))]


@contextlib.contextmanager
def served_engine(**engine_kwargs):
    """An Engine with the HTTP server on a free loopback port, for a module fixture: yields
    (engine, base_url) and stops both afterwards."""
    with served_engine_at("127.0.0.1", 0, **engine_kwargs) as pair:
        yield pair


@contextlib.contextmanager
def served_engine_at(host: str, port: int, **engine_kwargs):
    """served_engine on a given address (port 0: a free one)."""
    from workbench.core.engine import Engine
    from workbench.core.entrypoints.http_server import bind_socket, start_server

    engine = Engine(show_progress=False, **engine_kwargs)
    try:
        running = start_server(engine, engine.server_args, bind_socket(host, port))
        try:
            yield engine, running.url
        finally:
            running.stop(timeout_s=5)
    finally:
        engine.shutdown()
