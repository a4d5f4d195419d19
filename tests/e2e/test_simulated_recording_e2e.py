"""A simulated recording is complete, offline as live (issue #37): the same workload recorded by the
live simulated engine (the real tokenizer manager stamps its requests) and by the offline Simulator (its
front end stamps them) holds the same kinds of events, and both replay through the reducer to the same
TTFT and latency for every request. The fast checks are in tests/fast/test_simulated_recording.py.
"""

from __future__ import annotations

import pytest
from workbench.core.simulation.simulator import Simulator, poisson_workload, request_prompt
from workbench.core.trace.recorder import Recorder, read_trace
from workbench.core.trace.state import TraceState

pytestmark = pytest.mark.timeout(300)


def _kinds(events) -> set[str]:
    return {type(e).__struct_config__.tag for e in events}


def _state(header, events) -> TraceState:
    state = TraceState()
    state.apply_many([header, *events])
    return state


def test_the_live_and_the_offline_recordings_hold_the_same_events_and_figures(tmp_path):
    from workbench.core.engine import Engine
    from workbench.core.simulation.live import replay

    work = poisson_workload(rate=20, n=8, prompt_len=(50, 200), output_len=(2, 12), seed=3)
    live_path, offline_path = tmp_path / "live.jsonl", tmp_path / "offline.jsonl"
    sim = dict(simulate="h100", model_path="llama-3.1-8b", show_progress=False)
    with Engine(sim_speed=0, record=str(live_path), **sim) as engine:
        for i, r in enumerate(work):  # ids the stand-in tokenizer accepts, the same for both
            r.prompt_ids = request_prompt(i, r, 0, len(engine.tokenizer))
        replay(engine, work, seed=0)
    rec = Recorder(offline_path, model="SIMULATED h100x1 llama-3.1-8b")
    result = Simulator("llama-3.1-8b", "h100", trace_sink=rec).run(work)
    rec.close()
    live_header, live_events = read_trace(live_path)
    offline_header, offline_events = read_trace(offline_path)
    # req.text is the live one's only extra in what the requests and the scheduler do: its stand-in
    # tokenizer decodes the sampled ids. Process lifecycle events are left out: the offline run has no
    # processes, and whether the live recorder subscribed before a child announced itself is a race.
    lifecycle = {"proc.started", "proc.exited"}
    assert _kinds(offline_events) - lifecycle == _kinds(live_events) - {"req.text"} - lifecycle
    live_state, offline_state = _state(live_header, live_events), _state(offline_header, offline_events)
    for state in (live_state, offline_state):
        assert state.counters.num_requests_total == len(work)
        assert {r.state for r in state.requests.values()} == {"finished"}
        for rid, want in result.ttft.items():
            assert state.requests[rid].ttft == pytest.approx(want, abs=1e-6), rid
            assert state.requests[rid].e2e == pytest.approx(result.latency[rid], abs=1e-6), rid
