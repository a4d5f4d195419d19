"""A simulated run's recording is complete (issue #37): the offline Simulator's front end stamps what
the tokenizer manager stamps in a real engine (req.arrived, req.tokenized, req.first_token,
req.finished), on the simulated clock, so `workbench replay` of a `sim run --record` file shows what a
live run's recording shows. The recording, replayed through the reducer, gives every request the TTFT,
TPOT and latency the Simulator's own summary gives it, leaves none in flight, and explains each TTFT in
parts; the TUI over it shows the finished count and the Latency panel. `--simulate` without a model
takes the default model.
"""

from __future__ import annotations

import pytest
from workbench.core.simulation.calibration import Calibration
from workbench.core.simulation.simulator import SimRequest, Simulator, poisson_workload
from workbench.core.trace import events as ev
from workbench.core.trace.recorder import Recorder
from workbench.core.trace.replay import Replay
from workbench.core.trace.state import TraceState

# What a live engine's recording holds for every request (the tokenizer manager's and the scheduler's).
REQUEST_KINDS = {"req.arrived", "req.tokenized", "req.queued", "req.scheduled", "req.first_token", "req.finished"}

# A calibration with the trip through the tokenizer manager (bench calibrate measures it): requests
# reach the scheduler after they arrive and tokens reach the client after their step, so the arrival,
# queued and first-token stamps all differ.
TRIP = dict(tm_in_s=0.002, tm_gap_s=0.001, tm_out_s=0.003)
POINTS = [
    dict(kind="decode", batch=1, context=64, measured_s=1.0, predicted_s=1.0),
    dict(kind="extend", tokens=64, batch=1, context=64, measured_s=1.0, predicted_s=1.0),
]
SETUPS = {
    "plain": dict(max_running_requests=16),
    "trip": dict(calibration=Calibration("h100", "llama-3.1-8b", POINTS, TRIP)),
    "dp2": dict(dp_size=2, load_balance_method="shortest_queue"),
    "overlap": dict(disable_overlap_schedule=False, calibration=None),
}


def _record(path, setup: str, work: list[SimRequest]):
    rec = Recorder(path, model="SIMULATED h100x1 llama-3.1-8b")
    sim = Simulator("llama-3.1-8b", "h100", trace_sink=rec, **SETUPS[setup])
    try:
        result = sim.run(work)
    finally:
        rec.close()
    return result


def _replayed(path) -> tuple[TraceState, Replay]:
    """The recording as `workbench replay` plays it: every event released, folded by the reducer."""
    replay = Replay(str(path))
    replay.advance_to(replay.end_ns)
    state = TraceState()
    state.apply_many(replay.drain())
    return state, replay


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_simulated_recording_replays_to_the_simulators_own_figures(tmp_path, setup):
    work = poisson_workload(rate=40, n=24, prompt_len=(64, 400), output_len=(1, 24), seed=7, groups=2, prefix_len=48)
    path = tmp_path / "sim.jsonl"
    result = _record(path, setup, work)
    state, replay = _replayed(path)
    kinds = {type(e).__struct_config__.tag for e in replay.events}
    assert REQUEST_KINDS <= kinds

    assert set(result.latency) == {f"r{i}" for i in range(len(work))}
    assert state.counters.num_requests_total == len(result.latency)
    assert state.counters.generation_tokens_total == result.output_tokens
    assert state.counters.cached_tokens_total == result.cached_tokens
    in_flight = {rid: r.state for rid, r in state.requests.items() if r.state != "finished"}
    assert not in_flight and not state.waiting and not state.running
    by_rid = {f"r{i}": r for i, r in enumerate(work)}
    for rid, want in result.latency.items():
        r = state.requests[rid]
        assert r.arrival_ts == int(by_rid[rid].arrival * 1e9)  # sent at its arrival, on simulated time
        assert r.ttft == pytest.approx(result.ttft[rid], abs=1e-6)
        assert r.e2e == pytest.approx(want, abs=1e-6)
        assert r.tpot == pytest.approx(result.tpot.get(rid, 0.0), abs=1e-6)
        assert r.output_tokens == by_rid[rid].output_len
        # the stamps themselves say the same, and the TTFT's parts add up to it
        assert (r.first_token_ts - r.arrival_ts) / 1e9 == pytest.approx(result.ttft[rid], abs=1e-6)
        assert (r.finish_ts - r.arrival_ts) / 1e9 == pytest.approx(want, abs=1e-6)
        parts = state.ttft_parts(rid)
        assert parts is not None and not parts.partial
        assert sum(p.ns for p in parts.parts) == r.first_token_ts - r.arrival_ts
    if setup == "trip":  # the trip in: each request is queued after it arrived
        assert all(r.queued_ts > r.arrival_ts for r in state.requests.values())
    # the Latency panel's figures: every finish inside the last 60 s of the run
    pct = state.latency_percentiles(60.0, state.last_ts)
    assert pct["ttft"] is not None and pct["e2e"] is not None
    assert pct["ttft"][0] == pytest.approx(
        sorted(result.ttft.values())[int(0.5 * (len(result.ttft) - 1))], rel=0.5
    )  # the p50 is one of the simulated TTFTs' middle ones


def test_a_simulated_recording_is_a_workload_again(tmp_path):
    """The recording's arrivals and lengths (what `sim run --workload FILE` reads) are the workload's."""
    from workbench.core.simulation.recorded import workload_from_trace

    work = poisson_workload(rate=20, n=12, prompt_len=(50, 200), output_len=(2, 16), seed=3)
    path = tmp_path / "sim.jsonl"
    _record(path, "plain", work)
    again = workload_from_trace(path)
    t0 = work[0].arrival
    assert [(r.prompt_len, r.output_len) for r in again] == [(r.prompt_len, r.output_len) for r in work]
    assert [r.arrival for r in again] == pytest.approx([r.arrival - t0 for r in work], abs=1e-6)


def test_sim_run_record_writes_the_front_ends_events(tmp_path, capsys):
    """`workbench sim run --record`: the file the README's path from the simulator to the TUI replays."""
    from workbench.cli import build_parser

    path = tmp_path / "sim.jsonl"
    line = ["sim", "run", "--model", "llama-3.1-70b", "--simulate", "h100", "--tp-size", "8", "--rate", "20"]
    args = build_parser().parse_args([*line, "--num-requests", "16", "--record", str(path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    state, replay = _replayed(path)
    assert state.counters.num_requests_total == 16 and f"{16} requests in" in out
    assert all(r.state == "finished" and r.ttft is not None for r in state.requests.values())
    assert {e.proc for e in replay.events if isinstance(e, ev.ReqFirstToken)} == {"tokenizer"}


async def test_the_tui_over_a_simulated_recording_shows_done_and_latency(tmp_path):
    """The TUI replaying a simulated run: the status line's `done N` counts every request, and the
    Latency panel has TTFT figures (it showed dashes and `done 0` before the front end was traced)."""
    from textual.widgets import Static
    from tui_helpers import replay_app, show_at, wait_for
    from workbench.tui.panels.latency import latency_table

    work = poisson_workload(rate=20, n=20, prompt_len=(100, 300), output_len=(10, 30), seed=5)
    path = tmp_path / "sim.jsonl"
    rec = Recorder(path, model="SIMULATED h100x8 llama-3.1-70b")
    Simulator("llama-3.1-70b", "h100", tp_size=8, trace_sink=rec).run(work)
    rec.close()
    app, replay = replay_app(str(path))
    async with app.run_test(size=(160, 50)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        await wait_for(lambda: app.model.state.counters.num_requests_total == 20)
        app.refresh_panels(force=True)
        await pilot.pause()
        texts = " ".join(str(w.render()) for w in app.query(Static))
        assert "done 20" in texts
        rows = {}
        for row in zip(*(col._cells for col in latency_table(app.model).columns)):
            rows.setdefault(str(row[0]), []).append([str(c) for c in row[2:]])
        assert rows["TTFT"] and all("–" not in cell for cell in rows["TTFT"][-1])  # the 60 s window


@pytest.mark.parametrize("hardware", ["cpu-here", "h100"])
def test_simulate_without_a_model_takes_the_default_model(hardware):
    """`--simulate HW` / an `Engine` given `simulate=HW` without --model simulates the default model (its spec:
    SmolLM2-135M), as a real engine without --model serves it; resolved here without starting processes."""
    import argparse

    from workbench.core.args import ServerArgs
    from workbench.core.deployment import resolve_deployment
    from workbench.core.simulation import live
    from workbench.core.simulation.model_specs import KNOWN

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    given = ServerArgs.from_cli_args(parser.parse_args(["--simulate", hardware]))
    assert given.model_path is None
    sa, d = resolve_deployment(given)
    assert sa.model_path == live.DEFAULT_MODEL and KNOWN[live.DEFAULT_MODEL].name == "smollm2-135m"
    assert d.badge == f"SIMULATED {hardware}x1" and not d.loads_weights
    named = live.sized_args(ServerArgs(simulate=hardware, model_path="smollm2-135m"))
    assert sa == named  # the same deployment as naming it
    assert sa.max_total_tokens == live._cost_model(named).kv_pool_tokens()
