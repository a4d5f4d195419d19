"""Simulated PD deployments (issue #38 item 5): the real schedulers of prefill and decode replicas with
the real PrefillBootstrap and DecodeTransferQueue, over a KV transport on the simulated clock.

- 1P1D on a small model: every request's TTFT is prefill wait + prefill + transfer wait + transfer +
  decode wait, the
  transfer is the prompt's KV bytes / the link's bandwidth + its latency, and the recording's events say
  the same (req.arrived -> req.first_token, each side's pd.transfer with its bytes and ms);
- a request alone is slower through PD than co-located by exactly its transfer time;
- PD and co-located decide the same tokens (a workload with its tokens given: the prefill's first token
  crosses over, the decode side continues from it);
- halving the link's bandwidth lengthens every lone request's TTFT by its bytes / bandwidth;
- `workbench sim run --pd 2P4D` of a 70B model on H100s completes, and its recording replays.
"""

from __future__ import annotations

import pytest
from workbench.core.simulation.pd import PDSimulator, parse_pd, pd_ttft_check, prefill_rid
from workbench.core.simulation.simulator import SimRequest, Simulator, poisson_workload
from workbench.core.trace import events as ev
from workbench.core.trace.recorder import Recorder
from workbench.core.trace.replay import Replay
from workbench.core.trace.state import TraceState

MODEL, HW = "smollm2-135m", "cpu-here"
KW = dict(calibration=None, max_running_requests=16)


def _lone(n: int = 5) -> list[SimRequest]:
    """Requests far enough apart that each runs alone (no queue, no shared link)."""
    return [SimRequest(arrival=30.0 * i, prompt_len=40 + 37 * i, output_len=4 + i) for i in range(n)]


def _record(path, work, **kw):
    rec = Recorder(path, model="SIMULATED pd test")
    sim = PDSimulator(MODEL, HW, trace_sink=rec, **KW, **kw)
    try:
        return sim, sim.run(work)
    finally:
        rec.close()


def _events(path) -> list:
    replay = Replay(str(path))
    replay.advance_to(replay.end_ns)
    return list(replay.drain())


def test_parse_pd():
    assert parse_pd("2P4D") == (2, 4) and parse_pd("1p1d") == (1, 1)
    for bad in ("2P", "P4D", "0P1D", "2x4"):
        with pytest.raises(ValueError, match="xPyD"):
            parse_pd(bad)


def test_ttft_is_prefill_plus_transfer_plus_decode_wait_and_the_trace_agrees(tmp_path):
    work = _lone() + poisson_workload(rate=50, n=12, prompt_len=(32, 300), output_len=(2, 12), seed=3)
    for j, r in enumerate(work[5:]):
        r.arrival += 200.0  # a burst after the lone ones: queues and a shared link
    sim, res = _record(tmp_path / "pd.jsonl", work)
    assert set(res.ttft) == {f"r{i}" for i in range(len(work))} == set(res.ttft_parts)
    assert pd_ttft_check(res) < 1e-9
    per_token = sim.spec.kv_bytes_per_token(sim.prefill.cost.dtype_bytes)
    bw = sim.link_bw  # tp 1 on both sides: one link
    for i, r in enumerate(work):
        parts = res.ttft_parts[f"r{i}"]
        assert parts["transfer"] == pytest.approx(r.prompt_len * per_token / bw + sim.link.latency_s, rel=1e-9)
        assert min(parts.values()) >= 0
    assert res.transferred_bytes == per_token * sum(r.prompt_len for r in work)
    assert any(p["transfer_wait"] > 0 for p in res.ttft_parts.values())  # the burst queued on the link
    assert any(p["prefill_wait"] > 0 for p in res.ttft_parts.values())  # ... and for the prefill replica

    events = _events(tmp_path / "pd.jsonl")
    arrived = {e.rid: e.ts for e in events if isinstance(e, ev.ReqArrived)}
    first = {e.rid: e.ts for e in events if isinstance(e, ev.ReqFirstToken)}
    transfers = {(e.role, e.room): e for e in events if isinstance(e, ev.PDTransfer)}
    assert len(transfers) == 2 * len(work)
    for i, r in enumerate(work):
        rid, parts = f"r{i}", res.ttft_parts[f"r{i}"]
        assert (first[rid] - arrived[rid]) / 1e9 == pytest.approx(res.ttft[rid], abs=2e-9)
        got = transfers[("decode", i)]
        assert got.rid == rid and got.ok and got.tokens == r.prompt_len
        assert got.nbytes == r.prompt_len * per_token
        assert got.ms == pytest.approx(1000 * parts["transfer"], rel=1e-9)
        sent = transfers[("prefill", i)]
        assert sent.rid == prefill_rid(i) and sent.nbytes == got.nbytes
        assert sent.wait_ms == pytest.approx(1000 * parts["transfer_wait"], abs=1e-6)
        # the prefill side's answer (one token) is traced under its own rid, as a prefill server's
        assert prefill_rid(i) in first
    # replayed, the recording leaves nothing in flight and shows every replica
    state = TraceState()
    state.apply_many(events)
    # the PD views' own split of the recording (core/trace/pd.py, joined by room) agrees with the simulator's
    from workbench.core.trace.pd import pd_ttft_breakdown

    for i in range(len(work)):
        rid, parts = f"r{i}", res.ttft_parts[f"r{i}"]
        b = pd_ttft_breakdown(state, rid)
        assert (
            b is not None
            and not b.partial
            and (b.end_ts - b.arrival_ts) / 1e9 == pytest.approx(res.ttft[rid], abs=2e-9)
        )
        seen = {p.label: (p.end_ts - p.start_ts) / 1e9 for p in b.parts}
        assert seen["transfer"] == pytest.approx(parts["transfer"], abs=2e-9)
        before = seen["arrived → queued"] + seen["prefill queue"] + seen["prefill"]
        assert before == pytest.approx(parts["prefill_wait"] + parts["prefill"], abs=3e-9)
    assert state.requests[f"r{len(work) - 1}"].state == "finished"
    assert [v.proc for v in state.replicas()] == ["scheduler.dp0", "scheduler.dp1"]


def test_a_lone_request_pays_exactly_its_transfer_over_co_located():
    work = _lone()
    sim = PDSimulator(MODEL, HW, **KW)
    pd = sim.run(work)
    co = Simulator(MODEL, HW, **KW).run(work)
    for i, r in enumerate(work):
        extra = pd.ttft[f"r{i}"] - co.ttft[f"r{i}"]
        assert extra == pytest.approx(sim.link.transfer_s(r.prompt_len), rel=1e-6)
        parts = pd.ttft_parts[f"r{i}"]
        assert parts["prefill_wait"] == parts["transfer_wait"] == parts["decode_wait"] == 0
        # the prefill is the one pass the cost model prices for the prompt
        pass_s = sim.prefill.cost.step([r.prompt_len], [r.prompt_len]).total
        assert parts["prefill"] == pytest.approx(pass_s, rel=1e-9)


def test_pd_and_co_located_decide_the_same_tokens():
    work = poisson_workload(rate=20, n=10, prompt_len=(16, 120), output_len=(3, 9), seed=5)
    for i, r in enumerate(work):
        r.output_ids = [100 + 7 * i + j for j in range(r.output_len)]
    pd = PDSimulator(MODEL, HW, prefill_replicas=2, decode_replicas=1, **KW).run(work)
    co = Simulator(MODEL, HW, **KW).run(work)
    assert pd.outputs == co.outputs == {f"r{i}": r.output_ids for i, r in enumerate(work)}


def test_halving_the_bandwidth_adds_the_bytes_over_bandwidth():
    work = _lone()
    fast = PDSimulator(MODEL, HW, link_gbps=8.0, **KW)
    slow = PDSimulator(MODEL, HW, link_gbps=4.0, **KW)
    a, b = fast.run(work), slow.run(work)
    per_token = fast.spec.kv_bytes_per_token(fast.prefill.cost.dtype_bytes)
    for i, r in enumerate(work):
        nbytes = r.prompt_len * per_token
        assert b.ttft[f"r{i}"] - a.ttft[f"r{i}"] == pytest.approx(nbytes / (4e9 / 8) - nbytes / (8e9 / 8), rel=1e-6)
        assert b.ttft_parts[f"r{i}"]["transfer"] > a.ttft_parts[f"r{i}"]["transfer"]


def test_cli_70b_2p4d_on_h100s_records_a_replayable_run(tmp_path, capsys):
    from workbench.cli import main

    path = tmp_path / "pd70b.jsonl"
    argv = ["sim", "run", "--model", "llama-3.1-70b", "--simulate", "h100", "--pd", "2P4D", "--tp-size", "8"]
    argv += ["--rate", "40", "--num-requests", "24", "--prompt-len", "512,2048", "--output-len", "8,32"]
    argv += ["--max-running-requests", "32"]  # small request tables: the run, not their allocation, is timed
    assert main(argv + ["--record", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2P4D (prefill 2 x tp 8, decode 4 x tp 8), link 400 Gb/s per device" in out
    assert "24 requests" in out
    events = _events(path)
    transfers = [e for e in events if isinstance(e, ev.PDTransfer)]
    assert len(transfers) == 48 and all(e.ok for e in transfers)
    procs = {e.proc for e in events if isinstance(e, ev.BatchStep)}
    assert procs == {f"scheduler.dp{k}" for k in range(6)}
    # 8 links of 400 Gb/s: a 2048-token prompt of llama-3.1-70b (320 KiB a token in bf16) in under 2 ms
    assert max(e.ms for e in transfers) < 2.0


def test_pd_flags_without_pd_say_what_to_add(capsys):
    from workbench.cli import main

    with pytest.raises(SystemExit, match="--pd xPyD"):
        main(["sim", "run", "--model", MODEL, "--simulate", HW, "--pd-link-gbps", "10", "--num-requests", "1"])


async def test_the_tui_replays_a_pd_recording_with_every_replica(tmp_path):
    """`workbench replay` of a simulated 1P2D run: every request finished on both sides (the status line's
    `done` counts the prefill halves too, as two servers' traces do) and the three schedulers side by side."""
    from textual.widgets import Static
    from tui_helpers import replay_app, show_at, wait_for

    work = poisson_workload(rate=20, n=12, prompt_len=(100, 300), output_len=(4, 12), seed=5)
    path = tmp_path / "pd.jsonl"
    rec = Recorder(path, model="SIMULATED h100 1P2D llama-3.1-70b")
    PDSimulator("llama-3.1-70b", "h100", 1, 2, 8, 8, trace_sink=rec, max_running_requests=32).run(work)
    rec.close()
    app, replay = replay_app(str(path))
    async with app.run_test(size=(160, 50)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        await wait_for(lambda: app.model.state.counters.num_requests_total == 24)
        app.refresh_panels(force=True)
        await pilot.pause()
        assert "done 24" in " ".join(str(w.render()) for w in app.query(Static))
        assert [v.proc for v in app.model.state.replicas()] == ["scheduler.dp0", "scheduler.dp1", "scheduler.dp2"]
        assert all(r.state == "finished" for r in app.model.state.requests.values())
