"""End-to-end part of tests/fast/test_simulated_engine.py (what starts processes, engines or servers, or loads the
reference model).

A deployment that is not there, served live (core/simulation/live.py): the real tokenizer manager,
scheduler process and detokenizer over a simulated worker, every stamp on the shared simulated clock
(trace/clock.py). Checked: each pass moves simulated time by exactly the cost model's prediction and,
at --sim-speed 1, takes that long on the wall clock; a workload replayed through the whole pipeline at
--sim-speed 0 (as fast as this host can) and 10 gives every request the TTFT and latency the offline
`Simulator` gives it, in less wall time than simulated time; the TUI's workload runner keeps its rate in
simulated time; data-parallel replicas behind the real controller run side by side in simulated time
and agree with the offline Simulator request by request, as does speculative decoding (NGRAM and a
costed STANDALONE draft model); the SIMULATED badge in the trace's header, the recorder, the live TUI's
status line and every /metrics series; bad combinations refused with what to do instead."""

from __future__ import annotations

import time

import pytest
from workbench.core.simulation import live
from workbench.core.trace import events as ev

SIM = dict(simulate="h100", model_path="llama-3.1-70b", tp_size=8, show_progress=False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from workbench.core.engine import Engine

    path = tmp_path_factory.mktemp("sim") / "live.jsonl"
    eng = Engine(record=str(path), **SIM)
    eng.recording = path
    yield eng
    eng.shutdown()


def test_each_pass_takes_the_time_the_cost_model_predicts(engine):
    from pipeline_helpers import generate_traced

    prompt, new = list(range(100, 400)), 6
    outs, events = generate_traced(engine, [prompt], {"max_new_tokens": new, "temperature": 0.0})
    meta = outs[0]["meta_info"]
    assert meta["completion_tokens"] == new and meta["prompt_tokens"] == len(prompt)
    steps = [e for e in events if isinstance(e, ev.BatchStep) and e.mode != "idle"]
    assert [s.mode for s in steps] == ["extend"] + ["decode"] * (new - 1)
    cost = live._cost_model(engine.server_args)
    n = len(prompt)
    predicted = [cost.step([n], [n]).total] + [cost.step([1], [n + i + 1]).total for i in range(new - 1)]
    assert [s.forward_ms for s in steps] == pytest.approx([1000 * p for p in predicted], rel=1e-9)
    # simulated time: each step ends exactly its predicted pass after the one before (this host's own
    # work between passes is not the deployment's), and the client's latencies are the passes' sum
    for before, after, p in zip(steps, steps[1:], predicted[1:]):
        assert after.ts - before.ts == pytest.approx(p * 1e9, abs=2)
    assert meta["ttft"] == pytest.approx(predicted[0], abs=1e-6)
    assert meta["e2e_latency"] == pytest.approx(sum(predicted), abs=1e-6)
    # --sim-speed 1 (the default): the passes also take their time on the wall clock
    t0 = time.monotonic()
    again = engine.generate(input_ids=[list(range(500, 800))], sampling_params={"max_new_tokens": new})
    assert time.monotonic() - t0 >= 0.95 * again[0]["meta_info"]["e2e_latency"] > 0.95 * sum(predicted[1:])
    assert 0.002 < predicted[1] < 0.05  # a 70B decode step on 8 H100s: milliseconds, not this CPU's time
    # the text decodes with the stand-in tokenizer
    assert isinstance(outs[0]["text"], str) and outs[0]["text"]


def test_the_badge_is_in_the_label_the_ready_info_the_recording_and_the_tui(engine):
    from workbench.core.trace.replay import Replay

    assert engine.trace_label == "SIMULATED h100x8 llama-3.1-70b"
    assert engine.served_model_name == "llama-3.1-70b"  # the API's model name stays the model's
    assert engine.deployment.badge == "SIMULATED h100x8" and engine.trace_label.startswith("SIMULATED h100x8 ")
    assert engine.max_total_num_tokens == live._cost_model(engine.server_args).kv_pool_tokens()
    engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 2})
    assert Replay(str(engine.recording)).header.model == "SIMULATED h100x8 llama-3.1-70b"


async def test_the_live_tui_says_simulated_in_its_status_line(engine):
    from textual.widgets import Static
    from tui_helpers import wait_for
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import EngineController

    app = WorkbenchApp(EngineController(engine=engine, max_new_tokens=4))
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(app.ready.is_set, 30)
        assert app.controller.status().startswith("LIVE SIMULATED h100x8 llama-3.1-70b")
        app.controller.start_workload("shared-prefix", rate=50, max_requests=4, temperature=0.0)
        await wait_for(lambda: len(app.model.state.steps) > 3, 60)  # the simulated steps reach the views
        app.refresh_panels(force=True)
        await pilot.pause()
        assert "SIMULATED h100x8" in " ".join(str(w.render()) for w in app.query(Static))


def test_metrics_carry_the_deployment(engine):
    from fastapi.testclient import TestClient
    from workbench.core.entrypoints.http_server import create_app

    app = create_app(engine, engine.server_args)
    try:
        with TestClient(app) as client:
            r = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}})
            assert r.status_code == 200, r.text
            text = client.get("/metrics").text
    finally:
        app.state.metrics.close()
    lines = [line for line in text.splitlines() if line.startswith("sglang:prompt_tokens_total")]
    assert lines and all('simulated="h100x8"' in line and 'model_name="llama-3.1-70b"' in line for line in lines)


def test_the_live_dashboard_says_simulated_in_its_header(engine):
    from workbench.widgets.dashboard import Dashboard

    d = Dashboard(engine)
    try:
        engine.generate(input_ids=[[7, 8, 9]], sampling_params={"max_new_tokens": 3})
        deadline = time.monotonic() + 30
        while not d.state.steps and time.monotonic() < deadline:
            d.feed.pump(timeout=0.1)
        d.refresh()
        assert "SIMULATED h100x8 llama-3.1-70b" in d.header.value
    finally:
        d.close()


@pytest.fixture(scope="module", params=[0.0, 10.0], ids=["speed-max", "speed-10"])
def warped(request):
    from workbench.core.engine import Engine

    eng = Engine(sim_speed=request.param, **SIM)
    yield eng
    eng.shutdown()


def test_a_replayed_workload_gets_the_offline_simulators_figures_faster_than_real_time(warped):
    from workbench.core.simulation.simulator import Simulator, poisson_workload, request_prompt

    workload = poisson_workload(20, 40, (128, 2048), (16, 128), seed=1, groups=3, prefix_len=256)
    for i, r in enumerate(workload):  # the same prompts for both: ids the stand-in tokenizer accepts
        r.prompt_ids = request_prompt(i, r, 0, len(warped.tokenizer))
    got = live.replay(warped, workload)
    want = Simulator("llama-3.1-70b", "h100", tp_size=8).run(workload)
    assert set(got.ttft) == set(want.ttft) and len(got.ttft) == len(workload)
    for rid in want.ttft:  # request by request: the pipeline's figures are the deployment's
        assert got.ttft[rid] == pytest.approx(want.ttft[rid], abs=1e-6), rid
        assert got.latency[rid] == pytest.approx(want.latency[rid], abs=1e-6), rid
    assert (got.steps, got.output_tokens, got.cached_tokens) == (want.steps, want.output_tokens, want.cached_tokens)
    assert got.peak_kv_used == want.peak_kv_used > 0 and got.retracted == want.retracted
    assert got.sim_s == pytest.approx(want.sim_s, abs=1e-6)
    speed = warped.server_args.sim_speed
    # faster than real time (a loaded 2-core machine included); at speed 10 no faster than a tenth of it
    assert got.wall_s < got.sim_s / (4 if speed == 0 else 2)
    if speed:
        assert got.wall_s >= 0.9 * got.sim_s / speed
    assert not warped.get_internal_state()["num_running"]  # nothing left behind


def test_the_tuis_workload_runner_keeps_its_rate_in_simulated_time(warped):
    from pipeline_helpers import drain_events

    from workbench.workloads import WorkloadRunner

    sub = warped.subscribe(with_snapshot=False)
    try:
        start = warped.clock.now_ns()
        runner = WorkloadRunner(warped, "chat", rate=20, max_requests=12, max_new_tokens=8, ignore_eos=True)
        runner.start()
        deadline = time.monotonic() + 60
        while runner.completed + runner.failed < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
        runner.stop()
        assert runner.completed == 12, runner.last_error
        events = drain_events(sub, until=lambda evs: sum(isinstance(e, ev.ReqFinished) for e in evs) >= 12)
    finally:
        sub.close()
    arrived = sorted(e.ts for e in events if isinstance(e, ev.ReqArrived) and e.ts >= start)
    assert len(arrived) == 12
    gaps = [(b - a) / 1e9 for a, b in zip(arrived, arrived[1:])]
    # one every 1/20 s of simulated time, each at most one pass late (a request arriving mid-pass)
    assert all(0.05 - 1e-6 <= g <= 0.05 + 0.03 for g in gaps), gaps


def test_a_run_recorded_with_its_token_ids_replays_token_for_token(tmp_path, warped):
    """A real engine's run recorded with --trace-token-ids is a workload whose prompts and outputs are
    the recorded ones: the offline Simulator and the live pipeline return the recorded tokens, and the
    shared system prompt hits the simulated radix cache."""
    from workbench.core.engine import Engine
    from workbench.core.simulation.recorded import workload_from_trace
    from workbench.core.simulation.simulator import Simulator

    path = tmp_path / "run.jsonl"
    system = "You are a careful assistant who answers in one short sentence. " * 4
    prompts = [system + q for q in ("What is a radix tree?", "Why batch requests?", "What is KV cache?")]
    with Engine(record=str(path), trace_token_ids=True, show_progress=False) as real:
        first = real.generate(prompt=prompts[0], sampling_params={"max_new_tokens": 6, "temperature": 0.0})
        rest = real.generate(prompt=prompts[1:], sampling_params={"max_new_tokens": 6, "temperature": 0.0})
        want_prompts = [real.tokenizer.encode(p) for p in prompts]
    outs = [first] + rest
    workload = workload_from_trace(path)
    by_len = sorted(workload, key=lambda r: r.arrival)
    assert [r.prompt_ids for r in by_len][:1] == want_prompts[:1]
    assert sorted(map(tuple, (r.prompt_ids for r in workload))) == sorted(map(tuple, want_prompts))
    assert sorted(map(tuple, (r.output_ids for r in workload))) == sorted(tuple(o["output_ids"]) for o in outs)
    offline = Simulator("smollm2-135m", "h100").run(workload)
    live_run = live.replay(warped, workload)
    for got in (offline, live_run):
        assert sorted(map(tuple, got.outputs.values())) == sorted(tuple(o["output_ids"]) for o in outs)
        assert got.cached_tokens > 0  # the shared system prompt, recovered from the recorded ids


def _verdicts(path) -> list[tuple]:
    """Each request's speculative verdicts, (output length, drafts, accepted) in order, one tuple of
    them per request (sorted: the real and simulated runs name requests differently)."""
    from workbench.core.trace.recorder import read_trace

    by_rid: dict[str, list] = {}
    for e in read_trace(path)[1]:
        if isinstance(e, ev.SpecVerify) and not e.snapshot:
            for v in e.reqs:
                if v.drafts:
                    by_rid.setdefault(v.rid, []).append((v.at, tuple(v.drafts), v.accepted))
    return sorted(tuple(v) for v in by_rid.values())


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_a_speculative_runs_drafts_replay_and_stand_as_they_stood(tmp_path, capsys, algorithm):
    """A real engine's speculative run (tiny models, greedy), recorded with --trace-token-ids, replayed on
    a simulated deployment offline and through the live pipeline: each request proposes, at each output
    length, the drafts its real drafter proposed there (n-grams, or a one-layer draft model's), and they
    stand exactly as far as they stood: the same verdicts request by request, the same outputs and
    totals. `sim run --workload` replays them by itself; without them, drafts at the recording's accept
    rate give other verdicts (so the comparison means something)."""
    from tiny_models import make_tiny_llama
    from workbench.core.engine import Engine
    from workbench.core.simulation.recorded import recorded_speculation, workload_from_trace
    from workbench.core.simulation.simulator import Simulator
    from workbench.core.trace.recorder import Recorder

    from workbench.cli import build_parser

    target = make_tiny_llama(tmp_path / "target", tie_word_embeddings=False, seed=3)
    spec = dict(speculative_algorithm=algorithm, speculative_num_draft_tokens=3)
    if algorithm == "STANDALONE":
        spec["speculative_draft_model_path"] = str(make_tiny_llama(tmp_path / "draft", num_hidden_layers=1, seed=11))
    units = [[10 + (7 * i + j) % 200 for j in range(2 + i % 4)] for i in range(12)]
    prompts = [(u * 20)[: 6 + 3 * i] for i, u in enumerate(units)]  # repetitive: n-grams match
    real_path = tmp_path / "real.jsonl"
    with Engine(
        model_path=str(target),
        dtype="float32",
        record=str(real_path),
        trace_token_ids=True,
        show_progress=False,
        max_total_tokens=4096,
        **spec,
    ) as real:
        outs = real.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
        )
        state = real.get_internal_state()
    assert 0 < state["spec_accepted"] < state["spec_proposed"]  # some drafts stood, some fell
    recorded = recorded_speculation(real_path)
    assert (recorded.algorithm, recorded.num_draft_tokens) == (algorithm, 3)
    assert (recorded.proposed, recorded.accepted) == (state["spec_proposed"], state["spec_accepted"])
    want, outputs = _verdicts(real_path), sorted(tuple(o["output_ids"]) for o in outs)
    workload = workload_from_trace(real_path)
    assert all(r.drafts for r in workload) and len(want) == len(prompts)
    sim = dict(speculative_accept_rate=recorded.accept_rate, speculative_num_draft_tokens=3)

    offline_path = tmp_path / "offline.jsonl"
    with Recorder(str(offline_path), model="sim") as rec:
        offline = Simulator("llama-3.1-8b", "l4", trace_sink=rec, **sim).run(workload)
    live_path = tmp_path / "live.jsonl"
    with Engine(
        simulate="l4",
        model_path="llama-3.1-8b",
        sim_speed=0.0,
        record=str(live_path),
        show_progress=False,
        speculative_algorithm="NGRAM",
        **sim,
    ) as eng:
        live_run = live.replay(eng, workload)
    for got, path in ((offline, offline_path), (live_run, live_path)):
        assert _verdicts(path) == want
        assert sorted(map(tuple, got.outputs.values())) == outputs
        assert (got.spec_proposed, got.spec_accepted) == (recorded.proposed, recorded.accepted)

    # the command: the recording's drafts replayed by default, and left out when asked
    args_line = f"sim run --workload {real_path} --model llama-3.1-8b --simulate l4".split()
    args = build_parser().parse_args(args_line)
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert f"drafts kept {recorded.accepted} of {recorded.proposed} " in captured.out
    assert f"ran {algorithm} speculative decoding" in captured.err and "--ignore-recorded-drafts" in captured.err
    args = build_parser().parse_args([*args_line, "--ignore-recorded-drafts"])
    assert args.func(args) == 0
    assert "drafts kept" not in capsys.readouterr().out  # speculative decoding off
    for r in workload:
        r.drafts = None
    sampled_path = tmp_path / "sampled.jsonl"
    with Recorder(str(sampled_path), model="sim") as rec:
        Simulator("llama-3.1-8b", "l4", trace_sink=rec, **sim).run(workload)
    assert _verdicts(sampled_path) != want


@pytest.mark.parametrize("dp", [1, 2], ids=["one-scheduler", "dp-2"])
def test_the_overlap_loop_runs_live_and_agrees_with_the_offline_overlap_simulation(dp):
    """--no-disable-overlap-schedule on a live simulated engine: the scheduler's own overlap loop over
    a client with two timelines (the host's on the shared clock), as `Simulator(disable_overlap_schedule=
    False)` steps it offline: the same TTFT and latency for every request."""
    from workbench.core.engine import Engine
    from workbench.core.simulation.simulator import Simulator, poisson_workload, request_prompt

    workload = poisson_workload(20 * dp, 30 * dp, (128, 2048), (16, 128), seed=2, groups=2, prefix_len=256)
    deployment = dict(tp_size=8 // dp, dp_size=dp)  # with dp 2: each replica's host timeline its own
    with Engine(sim_speed=0.0, disable_overlap_schedule=False, **{**SIM, **deployment}) as eng:
        assert "overlap" in eng.scheduler_info["threads"]
        for i, r in enumerate(workload):
            r.prompt_ids = request_prompt(i, r, 0, len(eng.tokenizer))
        got = live.replay(eng, workload)
    want = Simulator("llama-3.1-70b", "h100", disable_overlap_schedule=False, **deployment).run(workload)
    normal = Simulator("llama-3.1-70b", "h100", **deployment).run(workload)
    assert want.ttft != normal.ttft  # the overlap loop schedules differently: the comparison means something
    for rid in want.ttft:
        assert got.ttft[rid] == pytest.approx(want.ttft[rid], abs=1e-6), rid
        assert got.latency[rid] == pytest.approx(want.latency[rid], abs=1e-6), rid


def _assert_same_requests(got, want) -> None:
    """The live pipeline's figures are the offline Simulator's, request by request."""
    assert set(got.ttft) == set(want.ttft) and got.ttft
    for rid in want.ttft:
        assert got.ttft[rid] == pytest.approx(want.ttft[rid], abs=1e-6), rid
        assert got.latency[rid] == pytest.approx(want.latency[rid], abs=1e-6), rid
    assert (got.steps, got.output_tokens, got.cached_tokens) == (want.steps, want.output_tokens, want.cached_tokens)
    assert got.peak_kv_used == want.peak_kv_used > 0 and got.retracted == want.retracted


@pytest.fixture(scope="module", params=[0.0, 10.0], ids=["speed-max", "speed-10"])
def replicated(request):
    from workbench.core.engine import Engine

    eng = Engine(sim_speed=request.param, dp_size=2, load_balance_method="prefix_aware", **{**SIM, "tp_size": 4})
    yield eng
    eng.shutdown()


def test_data_parallel_replicas_run_side_by_side_as_the_offline_simulator_steps_them(replicated):
    """--dp-size 2: the real data-parallel controller routes (prefix_aware, whose choice depends on the
    replicas' loads and outputs) to two replica processes, each keeping its own simulated time; every
    request gets the offline Simulator's TTFT and latency, each replica the same requests, and the
    replicas' passes overlap in simulated time (their busy time adds up to more than the run)."""
    from pipeline_helpers import drain_events
    from workbench.core.simulation.simulator import Simulator, poisson_workload, request_prompt

    assert replicated.trace_label == "SIMULATED h100x8 (dp 2 x tp 4) llama-3.1-70b"
    workload = poisson_workload(25, 50, (128, 2048), (16, 128), seed=3, groups=4, prefix_len=512)
    for i, r in enumerate(workload):
        r.prompt_ids = request_prompt(i, r, 0, len(replicated.tokenizer))
    sub = replicated.subscribe(with_snapshot=False)
    try:
        got = live.replay(replicated, workload)
        events = drain_events(sub, until=lambda evs: sum(isinstance(e, ev.ReqFinished) for e in evs) >= 50)
    finally:
        sub.close()
    want = Simulator("llama-3.1-70b", "h100", tp_size=4, dp_size=2, load_balance_method="prefix_aware").run(workload)
    _assert_same_requests(got, want)
    assert got.per_replica_requests == want.per_replica_requests and min(want.per_replica_requests) > 0
    steps = [e for e in events if isinstance(e, ev.BatchStep) and e.mode != "idle"]
    assert {s.proc for s in steps} == {"scheduler.dp0", "scheduler.dp1"}
    for proc in ("scheduler.dp0", "scheduler.dp1"):  # each replica's stamps: its own passes, in order
        mine = [s for s in steps if s.proc == proc]
        assert all(b.ts - a.ts >= b.forward_ms * 1e6 - 2 for a, b in zip(mine, mine[1:]))
    assert sum(s.forward_ms for s in steps) / 1000 > 1.2 * got.sim_s  # side by side, not one after the other
    speed = replicated.server_args.sim_speed
    assert got.wall_s < got.sim_s / 2
    if speed:  # one pacing for both replicas: at least a tenth of the simulated time, once
        assert got.wall_s >= 0.9 * got.sim_s / speed
    assert not replicated.get_internal_state()["num_running"]


@pytest.mark.parametrize("draft", [None, "llama-3.1-8b"], ids=["ngram", "standalone-8b"])
def test_speculative_decoding_runs_live_and_agrees_with_the_offline_simulator(draft):
    """--speculative-algorithm with --speculative-accept-rate on a live simulated engine: the scheduler's
    own verify path with simulated drafts (a STANDALONE draft model's passes costed before each verify),
    the offline Simulator's figures for every request, and the drafts really kept at about the rate."""
    from workbench.core.engine import Engine
    from workbench.core.simulation.simulator import Simulator, poisson_workload, request_prompt

    workload = poisson_workload(20, 30, (128, 1024), (32, 128), seed=4)
    algo = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft) if draft else {}
    with Engine(sim_speed=0.0, speculative_accept_rate=0.7, **{"speculative_algorithm": "NGRAM", **algo}, **SIM) as eng:
        for i, r in enumerate(workload):
            r.prompt_ids = request_prompt(i, r, 0, len(eng.tokenizer))
        got = live.replay(eng, workload)
        state = eng.get_internal_state()
    want = Simulator(
        "llama-3.1-70b", "h100", tp_size=8, speculative_accept_rate=0.7, speculative_draft_model=draft
    ).run(workload)
    plain = Simulator("llama-3.1-70b", "h100", tp_size=8).run(workload)
    assert want.steps < plain.steps  # drafts kept: fewer passes, the comparison means something
    _assert_same_requests(got, want)
    proposed, accepted = state["spec_proposed"], state["spec_accepted"]
    assert proposed > 100 and 0.3 < accepted / proposed < 0.7  # kept until the first miss: below 0.7 each


def test_sim_run_live_takes_data_parallel_and_speculative_decoding_from_the_command_line(capsys):
    """`workbench sim run --live --dp-size 2 --speculative-accept-rate ... --speculative-draft-model ...
    --compare`: the flags reach the live engine (replicas, costed draft model) and the offline Simulator
    alike, and the command prints that they agree request by request."""
    from workbench.cli import build_parser

    args = build_parser().parse_args(
        "sim run --live --compare --model llama-3.1-70b --simulate h100 --tp-size 4 --dp-size 2 --rate 20 "
        "--num-requests 24 --output-len 16,64 --load-balance-method shortest_queue --speculative-accept-rate 0.6 "
        "--speculative-draft-model llama-3.1-8b".split()
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    live_line, offline_line = [ln for ln in out.splitlines() if ln.startswith("SIMULATED h100x8 (dp 2 x tp 4)")]
    assert "[live pipeline" in live_line and "[offline Simulator]" in offline_line
    assert live_line.split("[")[0].split(" s real")[1] == offline_line.split("[")[0].split(" s real")[1]
    assert "largest per-request TTFT difference, live against offline: 0.000 ms" in out
