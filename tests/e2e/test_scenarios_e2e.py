"""Demo scenarios on the real engine (default model), end to end (issue #15 item 5).

- A recording of `kv-pressure` holds waiting requests, evictions and retractions within a minute
  of its first request, its narrated steps (`batch.decision`) say so, and every finished request's
  TTFT parts sum to its TTFT.
- The shared-prefix scenario in the real TUI (Textual Pilot): a waiting queue and an
  eviction within its first minute, the adaptive rate in the status line, and `p` pausing the
  workload's arrivals with the scheduler.
"""

from __future__ import annotations

import time

import pytest
from tui_helpers import wait_for
from workbench.core.trace import events as ev

from workbench.scenarios import get_scenario, record_run

# Each test starts its own engine (with the scenario's settings).
pytestmark = pytest.mark.timeout(600)


def test_a_kv_pressure_recording_holds_waiting_evictions_and_retractions(tmp_path):
    from workbench.core.args import ServerArgs
    from workbench.core.trace.recorder import load_trace
    from workbench.core.trace.state import TraceState

    scn = get_scenario("kv-pressure")
    out = tmp_path / "kv-pressure.jsonl"
    result = record_run(
        scn.server_args(ServerArgs(show_progress=False)),
        str(out),
        scn.runner,
        duration_s=120,
        # the hard cases, and a finished request whose TTFT parts can be checked (under load the
        # hard cases can all come before any request has finished)
        stop_when=lambda s: s.hard_cases_seen() and s.finished > 0,
        progress=lambda line: None,
    )
    assert result.failed == 0, result.summary()

    # Judged from the file, not from what the run counted on the way.
    events = load_trace(out)
    first = min(e.ts for e in events if isinstance(e, ev.ReqArrived))
    evictions = [e for e in events if isinstance(e, ev.CacheEvict) and e.tokens > 0]
    retractions = [e for e in events if isinstance(e, ev.ReqRetracted)]
    waiting = [e for e in events if isinstance(e, ev.QueueState) and e.waiting]
    assert evictions and retractions and waiting, result.summary()
    for what, found in (("eviction", evictions), ("retraction", retractions), ("waiting queue", waiting)):
        within = (found[0].ts - first) / 1e9
        assert within < 60, f"the first {what} came {within:.0f} s after the first request"

    # The narrated steps carry what happened: one batch.decision per batch.step, the retracted rids,
    # the evicted tokens and nodes, KV slots, the prefill budget and why requests were left waiting.
    steps = {e.step for e in events if isinstance(e, ev.BatchStep)}
    decisions = {e.step: e for e in events if isinstance(e, ev.StepDecision)}
    assert steps and steps <= set(decisions)
    retracted = {e.rid for e in retractions}
    assert retracted == {rid for d in decisions.values() for rid in d.retracted}
    assert sum(d.evicted for d in decisions.values()) == sum(e.tokens for e in evictions)
    assert any(d.evicted_nodes for d in decisions.values())
    extends = [d for d in decisions.values() if d.mode == "extend"]
    assert extends and all(d.budget > 0 and d.kv_alloc > 0 for d in extends)
    assert any(d.admitted for d in extends)
    assert any(d.stop_reason == "kv" and d.stop_rid for d in decisions.values()), (
        "no step said requests waited for KV room"
    )

    # ... and TraceState tells a retraction step in words.
    st = TraceState()
    step_of = next(d.step for d in decisions.values() if d.retracted)
    for e in events:
        st.apply(e)
        if isinstance(e, ev.StepDecision) and e.step == step_of:
            break
    assert "retracted" in st.last_step_line, st.last_step_line

    # The TTFT parts of every finished request sum to its TTFT exactly.
    from synthetic import check_ttft_sums

    whole = TraceState()
    whole.apply_many(events)
    finished = [rid for rid, r in whole.requests.items() if r.state == "finished"]
    assert finished  # (the run stops once the hard cases are seen: a retracted request may not be done)
    for rid in finished:
        check_ttft_sums(whole, rid)


async def test_make_run_scenario_shows_a_queue_and_an_eviction_and_p_pauses_its_arrivals():
    from workbench.core.args import ServerArgs
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import EngineController

    scn = get_scenario("shared-prefix")
    controller = EngineController(server_args=scn.server_args(ServerArgs(show_progress=False)), scenario=scn)
    app = WorkbenchApp(controller, layout="grid")
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(app.ready.is_set, 240)
        # the events log says what the scenario sets up and what to watch
        assert any("Watch:" in line.text for line in app.model.log.lines), "no scenario note"
        st = app.model.state
        t0 = time.monotonic()
        seen = {"waiting": 0}

        def queue_and_eviction():
            seen["waiting"] = max(seen["waiting"], st.queue_counts()["waiting"])
            return seen["waiting"] > 0 and st.counters.evicted_tokens_total > 0

        await wait_for(queue_and_eviction, 120, interval=0.1)
        assert time.monotonic() - t0 < 60, "a waiting queue and an eviction took over a minute"
        runner = controller.runner
        assert runner.adaptive and runner.in_flight <= scn.max_in_flight

        # the status line shows the adaptive rate and the measured throughput it follows
        def status():
            return str(app.query_one("#status").render())

        await wait_for(lambda: "done/s" in status(), 20)
        assert "scenario shared-prefix" in status() and "req/s (auto: " in status(), status()

        await pilot.press("p")
        await wait_for(lambda: controller.paused and runner.paused, 30)
        await pilot.pause(0.5)  # a send already decided may still go out
        sent = runner.sent
        await pilot.pause(2.0)
        assert runner.sent == sent, "the workload kept sending while the scheduler was paused"
        app._update_status()
        assert "(paused)" in str(app.query_one("#status").render())
        await pilot.press("p")
        await wait_for(lambda: not controller.paused and runner.sent > sent, 60)
