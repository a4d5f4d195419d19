"""Simulation at scale (issue #19): the cost model's shape, model sizes against transformers, and the
real Scheduler run over a simulated clock (every request to its exact length, the KV invariants,
simulated timestamps in the trace, determinism), and the CLI's sweep table.

The end-to-end tests of this module are in tests/e2e/test_simulation_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_family, make_tiny_llama
from workbench.core.simulation.cost_model import CostModel
from workbench.core.simulation.hardware import get_hardware
from workbench.core.simulation.model_specs import KNOWN, model_spec
from workbench.core.simulation.simulator import SimRequest, Simulator, poisson_workload


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral", "qwen3"])
def test_parameter_counts_equal_transformers(tmp_path, family):
    """A config.json read as a ModelSpec counts the parameters transformers builds from it."""
    from transformers import AutoModelForCausalLM

    d = make_tiny_llama(tmp_path / family) if family == "llama" else make_tiny_family(tmp_path / family, family)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    spec = model_spec(str(d))
    assert spec.total_params() == model.num_parameters() - norms  # norms are noise at scale: not counted


def test_decode_is_bandwidth_bound_prefill_compute_bound_and_tp_splits_both():
    spec, h100 = KNOWN["llama-3.1-70b"], get_hardware("h100")
    one, eight = CostModel(spec, h100, tp=1), CostModel(spec, h100, tp=8)
    decode = one.step([1], [1000])
    weights = spec.total_params() * 2
    assert decode.linear == pytest.approx(weights / (h100.mem_bw * h100.bw_efficiency), rel=0.02)
    prefill = one.step([8192], [8192])
    flops = 2 * 8192 * (spec.total_params() - spec.embed_params() + spec.vocab * spec.hidden / 8192)
    assert prefill.linear == pytest.approx(flops / (h100.peak_flops * h100.flop_efficiency), rel=0.02)
    assert prefill.attention > 100 * decode.attention
    d8 = eight.step([1], [1000])
    assert d8.linear == pytest.approx(decode.linear / 8, rel=1e-6) and d8.comm > 0 and decode.comm == 0
    # a step of 64 decodes costs far less than 64 steps of one (the weights are read once)
    assert one.step([1] * 64, [1000] * 64).total < 3 * decode.total
    moe = CostModel(KNOWN["qwen3-30b-a3b"], h100)
    assert moe.step([1], [100]).linear < moe.step([1] * 256, [100] * 256).linear / 4  # few experts hit at bs 1


def test_the_kv_pool_comes_from_memory_and_says_when_a_model_does_not_fit():
    spec = KNOWN["llama-3.1-70b"]
    eight = CostModel(spec, get_hardware("h100"), tp=8)
    per_rank = 80e9 * 0.85 - spec.total_params() * 2 / 8
    assert eight.kv_pool_tokens() == int(per_rank // (2 * 80 * 1 * 128 * 2))  # 8 KV heads over 8 ranks: 1 each
    with pytest.raises(ValueError, match="does not fit"):
        CostModel(spec, get_hardware("h100"), tp=1).kv_pool_tokens()
    with pytest.raises(ValueError, match="neither a known model"):
        model_spec("no-such-model")


def test_the_real_scheduler_runs_a_stream_on_simulated_time():
    events: list = []
    sim = Simulator("llama-3.1-8b", "h100", trace_sink=events.extend, max_running_requests=32)
    work = poisson_workload(rate=50, n=120, prompt_len=(64, 600), output_len=(8, 64), seed=3, groups=3, prefix_len=256)
    result = sim.run(work)
    assert len(result.latency) == 120 and result.output_tokens == sum(r.output_len for r in work)
    assert all(0 < result.ttft[rid] <= result.latency[rid] for rid in result.latency)
    assert result.cached_tokens > 0  # shared prefixes hit the radix cache
    sim.scheduler.check_kv_invariants()
    assert not sim.scheduler.has_work()
    steps = [e for e in events if type(e).__name__ == "BatchStep"]
    assert steps and [e.ts for e in steps] == sorted(e.ts for e in steps)
    assert steps[-1].ts <= sim.clock.now * 1e9 + 1 and steps[0].ts >= 0  # the trace carries simulated time
    assert result.sim_s >= max(r.arrival for r in work)
    again = Simulator("llama-3.1-8b", "h100", max_running_requests=32).run(work)
    assert again.metrics() == result.metrics()  # deterministic


def test_kv_pressure_retracts_and_still_finishes_everything():
    sim = Simulator("smollm2-135m", "cpu-here", max_total_tokens=2048, max_running_requests=32)
    work = [SimRequest(0.0, 200, 300) for _ in range(12)]
    result = sim.run(work)
    assert len(result.latency) == 12 and result.output_tokens == 12 * 300 and result.retracted > 0
    sim.scheduler.check_kv_invariants()


def test_sim_sweep_prints_one_row_per_setting(capsys, tmp_path):
    from workbench.cli import build_parser

    wl = tmp_path / "w.jsonl"
    wl.write_text(
        "\n".join(json.dumps({"arrival": i * 0.01, "prompt_tokens": 300, "output_tokens": 20}) for i in range(40))
    )
    args = build_parser().parse_args(
        [
            "sim",
            "sweep",
            "--model",
            "llama-3.1-8b",
            "--workload",
            str(wl),
            "--vary",
            "schedule_policy=fcfs,lpm",
            "--vary",
            "chunked_prefill_size=128,4096",
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| schedule_policy=")]
    assert len(rows) == 4 and "SIMULATED h100x1" in out
    # and as a plot: one bar per setting in each panel
    page = tmp_path / "sweep.html"
    args = build_parser().parse_args(
        ["sim", "sweep", "--model", "llama-3.1-8b", "--workload", str(wl), "--vary", "schedule_policy=fcfs,lpm"]
        + ["--plot", str(page)]
    )
    assert args.func(args) == 0
    html = page.read_text()
    assert "plotly" in html and html.count("schedule_policy=lpm") >= 7 and "TTFT ms" in html
    # replicas as a swept setting: TP 2 on one replica against two replicas of one device each
    args = build_parser().parse_args(
        ["sim", "sweep", "--model", "llama-3.1-8b", "--workload", str(wl), "--vary", "dp_size=1,2", "--tp-size", "1"]
    )
    assert args.func(args) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| dp_size=")]
    assert [r.split(" | ")[0] for r in rows] == ["| dp_size=1", "| dp_size=2"]


def test_calibration_interpolates_and_scales_the_passes(tmp_path):
    from workbench.core.simulation.calibration import Calibration

    cal = Calibration(
        "h100",
        "llama-3.1-8b",
        [
            dict(kind="decode", batch=1, context=64, measured_s=2.0, predicted_s=1.0),
            dict(kind="decode", batch=4, context=64, measured_s=4.0, predicted_s=1.0),
            dict(kind="extend", tokens=128, batch=1, context=128, measured_s=3.0, predicted_s=1.0),
        ],
    )
    assert cal.factor([1]) == 2.0 and cal.factor([1, 1]) == pytest.approx(3.0) and cal.factor([1] * 64) == 4.0
    assert cal.factor([500]) == 3.0 and cal.factor([7, 9]) == 3.0  # clamped at the ends; one curve per kind
    cal.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json").points == cal.points
    work = poisson_workload(rate=0, n=16, prompt_len=(100, 200), output_len=(20, 40), seed=2)
    plain = Simulator("llama-3.1-8b", "h100", calibration=None).run(work)
    slow = Simulator("llama-3.1-8b", "h100", calibration=tmp_path / "c.json").run(work)
    assert slow.sim_s > 2 * plain.sim_s and slow.output_tokens == plain.output_tokens


def test_prefill_calibration_fits_the_linear_and_attention_parts_apart():
    """Prefill points that carry their predicted parts are fitted as a*linear + b*attention +
    c*overhead (relative error, no negative weight), and the cost model weights a prefill's parts by
    the fit (decode keeps its per-batch factor), so prompts of one token count but different shapes
    are corrected differently."""
    from workbench.core.simulation.calibration import Calibration, extend_point
    from workbench.core.simulation.cost_model import CostModel
    from workbench.core.simulation.hardware import get_hardware
    from workbench.core.simulation.model_specs import model_spec

    raw = CostModel(model_spec("smollm2-135m"), get_hardware("cpu-here"), 1, 4)
    points = [dict(kind="decode", batch=1, context=64, measured_s=0.05, predicted_s=0.025)]
    for b, n in [(1, 32), (1, 512), (1, 2048), (4, 512), (16, 128), (32, 64)]:
        c = raw.step([n] * b, [n] * b)
        true = 2.0 * c.linear + 5.0 * c.attention + 1.5 * c.overhead
        points.append(extend_point(b, n, true, (c.linear, c.attention, c.overhead)))
    cal = Calibration("cpu-here", "smollm2-135m", points)
    assert cal.extend_fit() == pytest.approx((2.0, 5.0, 1.5), rel=1e-6)
    fitted = CostModel(model_spec("smollm2-135m"), get_hardware("cpu-here"), 1, 4, calibration=cal)
    for b, n in [(1, 2048), (32, 64), (8, 200)]:
        c = raw.step([n] * b, [n] * b)
        assert fitted.step([n] * b, [n] * b).total == pytest.approx(2 * c.linear + 5 * c.attention + 1.5 * c.overhead)
    assert fitted.step([1], [64]).total == pytest.approx(2.0 * raw.step([1], [64]).total)  # decode: its factor
    # a table without the parts (older files) keeps the per-token-count factor
    older = [
        {k: v for k, v in p.items() if k not in ("pred_linear", "pred_attention", "pred_overhead")} for p in points
    ]
    assert Calibration("cpu-here", "smollm2-135m", older).extend_fit() is None


def test_a_simulated_run_records_a_trace_the_views_read(tmp_path):
    """`sim run --record`: a recording whose header says SIMULATED, folded by the views' reducer."""
    from workbench.core.trace.recorder import read_trace
    from workbench.core.trace.state import TraceState

    from workbench.cli import build_parser

    path = tmp_path / "sim.jsonl"
    args = build_parser().parse_args(
        [
            "sim",
            "run",
            "--model",
            "llama-3.1-8b",
            "--simulate",
            "h100",
            "--num-requests",
            "30",
            "--rate",
            "20",
            "--record",
            str(path),
        ]
    )
    assert args.func(args) == 0
    header, events = read_trace(path)
    assert header.model.startswith("SIMULATED h100x1")
    args = build_parser().parse_args(
        [
            "sim",
            "run",
            "--num-requests",
            "20",
            "--rate",
            "20",
            "--dp-size",
            "2",
            "--load-balance-method",
            "shortest_queue",
            "--record",
            str(tmp_path / "dp.jsonl"),
        ]
    )
    assert args.func(args) == 0
    dp_header, dp_events = read_trace(tmp_path / "dp.jsonl")
    assert dp_header.model == "SIMULATED h100x2 (dp 2 x tp 1) llama-3.1-8b"
    dp_state = TraceState()
    dp_state.apply_many([dp_header, *dp_events])
    assert [v.requests for v in dp_state.replicas()] == [10, 10]
    state = TraceState()
    state.apply_many([header, *events])
    assert len(state.steps) > 10 and state.model.startswith("SIMULATED") and state.kv is not None
    assert state.last_ts == max(e.ts for e in events) < 60e9  # simulated seconds, not this machine's clock


async def test_the_tui_replays_a_simulated_run_with_its_badge(tmp_path):
    """The TUI over a simulated recording (Pilot): the status line says SIMULATED, the batch panel fills."""
    from textual.widgets import Static
    from tui_helpers import replay_app, show_at, wait_for
    from workbench.core.trace.recorder import Recorder

    path = tmp_path / "sim.jsonl"
    rec = Recorder(path, model="SIMULATED h100x8 llama-3.1-70b")
    Simulator("llama-3.1-70b", "h100", tp_size=8, trace_sink=rec).run(
        poisson_workload(rate=20, n=20, prompt_len=(100, 300), output_len=(10, 30), seed=5)
    )
    rec.close()
    app, replay = replay_app(str(path))
    async with app.run_test(size=(160, 50)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        await wait_for(lambda: "SIMULATED h100x8" in app.controller.status())
        assert len(app.model.state.steps) > 5
        texts = " ".join(str(w.render()) for w in app.query(Static))
        assert "SIMULATED h100x8" in texts


def test_data_parallel_replicas_run_side_by_side_on_simulated_time():
    """Two replicas behind round robin, given 2N identical requests at once, each run what one
    scheduler runs on N: the same simulated time and the same TTFTs, each request twice."""
    one = Simulator("llama-3.1-8b", "h100", max_running_requests=8).run([SimRequest(0.0, 300, 40)] * 12)
    two = Simulator("llama-3.1-8b", "h100", max_running_requests=8, dp_size=2).run([SimRequest(0.0, 300, 40)] * 24)
    assert two.per_replica_requests == [12, 12] and len(two.latency) == 24
    assert two.sim_s == pytest.approx(one.sim_s, rel=1e-9)
    assert sorted(two.ttft.values()) == pytest.approx(sorted([*one.ttft.values()] * 2), rel=1e-9)
    assert two.output_tokens == 2 * one.output_tokens and two.steps == 2 * one.steps
    assert "h100x2 (dp 2 x tp 1)" in two.summary() and two.kv_pool_tokens == 2 * one.kv_pool_tokens


def test_data_parallel_routing_is_the_controllers_and_is_traced():
    """prefix_aware keeps each shared-prefix group on one replica (the real LoadBalancer decides), so
    it hits the radix cache more than round robin, which computes each prefix on both replicas; the trace has one ReqDispatched per request, on
    simulated time, and the reducer maps each request to its replica."""
    from workbench.core.trace.state import TraceState

    work = poisson_workload(rate=10, n=64, prompt_len=(600, 900), output_len=(8, 32), seed=5, groups=16, prefix_len=512)
    events: list = []
    aware = Simulator(
        "llama-3.1-8b", "h100", dp_size=2, load_balance_method="prefix_aware", trace_sink=events.extend
    ).run(work)
    rr = Simulator("llama-3.1-8b", "h100", dp_size=2, load_balance_method="round_robin").run(work)
    assert len(aware.latency) == len(rr.latency) == 64
    # round robin computes each group's prefix on both replicas (measured 0.35 against 0.50)
    assert aware.metrics()["cache_hit_rate"] > rr.metrics()["cache_hit_rate"] + 0.05
    dispatched = [e for e in events if type(e).__name__ == "ReqDispatched"]
    assert len(dispatched) == 64 and {e.method for e in dispatched} == {"prefix_aware"}
    rank = {e.rid: e.dp_rank for e in dispatched}
    by_group: dict = {}
    for i, r in enumerate(work):
        by_group.setdefault(r.group, []).append(rank[f"r{i}"])
    # mostly on one replica each (the balancer still moves some when one replica runs far ahead)
    kept = sum(max(ranks.count(0), ranks.count(1)) for ranks in by_group.values())
    assert kept >= 0.9 * len(work)
    arrivals = sorted(int(r.arrival * 1e9) for r in work)
    assert [e.ts for e in dispatched] == arrivals  # stamped at arrival, in simulated time
    state = TraceState()
    state.apply_many(events)
    assert [v.proc for v in state.replicas()] == ["scheduler.dp0", "scheduler.dp1"]
    assert state.req_replica == {e.rid: f"scheduler.dp{e.dp_rank}" for e in dispatched}


def test_the_overlap_loop_hides_host_work_behind_the_pass():
    """disable_overlap_schedule=False runs the scheduler's own overlap loop over a client with a host
    and a device timeline: a decode step then takes max(host overhead, compute), not their sum. A 135M
    model on an H100 is host-bound (0.4 ms of overhead, ~0.12 ms of compute at batch 8)."""
    work = [SimRequest(0.0, 200, 100) for _ in range(8)]
    tpot = {}
    for overlap in (False, True):
        sim = Simulator("smollm2-135m", "h100", disable_overlap_schedule=not overlap, calibration=None)
        result = sim.run(work)
        assert len(result.latency) == 8 and result.output_tokens == 800
        sim.scheduler.check_kv_invariants()
        assert not sim.scheduler.has_work() and sim.scheduler.enable_overlap == overlap
        tpot[overlap] = result.metrics()["tpot_p50_ms"] / 1000
        step = sim.cost.step([1] * 8, [250] * 8)
    compute = step.total - step.overhead
    assert tpot[False] == pytest.approx(step.overhead + compute, rel=0.05)
    assert tpot[True] == pytest.approx(max(step.overhead, compute), rel=0.05)
    # compute-bound (a 70B model at batch 64): overlap saves the overhead per step, no more
    big = [SimRequest(0.0, 500, 64) for _ in range(64)]
    normal = Simulator("llama-3.1-70b", "h100", tp_size=8, calibration=None).run(big)
    overlapped = Simulator("llama-3.1-70b", "h100", tp_size=8, calibration=None, disable_overlap_schedule=False)
    over = overlapped.run(big)
    overhead = overlapped.cost.step([1] * 64, [530] * 64).overhead
    saved = normal.metrics()["tpot_p50_ms"] - over.metrics()["tpot_p50_ms"]
    assert saved == pytest.approx(1000 * overhead, rel=0.1)


def test_speculative_decoding_keeps_drafts_at_the_given_rate():
    """speculative_accept_rate: the scheduler's own speculative path (budgets, verify batches,
    keeping drafts up to the first disagreement) over a simulated drafter whose drafts the verify pass
    agrees with at that rate: kept / proposed is E[accepted] / k = (a + a^2 + ... + a^k) / k, every
    draft at 1.0, and a memory-bound deployment decodes faster per token; spec.verify is traced."""
    work = [SimRequest(0.0, 200, 400) for _ in range(8)]
    plain = Simulator("llama-3.1-8b", "h100", calibration=None).run(work)
    for rate in (1.0, 0.6, 0.9):
        events: list = []
        sim = Simulator(
            "llama-3.1-8b",
            "h100",
            calibration=None,
            speculative_accept_rate=rate,
            speculative_num_draft_tokens=4,
            trace_sink=events.extend,
        )
        result = sim.run(work)
        s = sim.scheduler
        assert len(result.latency) == 8 and result.output_tokens == 8 * 400
        s.check_kv_invariants()
        assert not s.has_work() and s.spec_proposed_total > 0
        expected = sum(rate**j for j in range(1, 5)) / 4
        assert s.spec_accepted_total / s.spec_proposed_total == pytest.approx(expected, abs=0.03)
        verifies = [e for e in events if type(e).__name__ == "SpecVerify"]
        assert sum(r.accepted for e in verifies for r in e.reqs) == s.spec_accepted_total
        if rate == 1.0:
            assert result.steps < plain.steps / 4
        if rate == 0.9:  # a verify pass of 5 rows costs about one decode step when weights dominate
            assert result.metrics()["tpot_p50_ms"] < 0.5 * plain.metrics()["tpot_p50_ms"]
    with pytest.raises(ValueError, match="speculative_accept_rate"):
        Simulator("llama-3.1-8b", "h100", speculative_accept_rate=1.5)


def test_the_trip_through_the_tokenizer_manager_spreads_a_burst_and_delays_tokens():
    """A calibration's tm_in_s / tm_gap_s / tm_out_s (what `bench calibrate` measures on the real
    pipeline): requests sent at once reach the scheduler a gap apart, so the first is prefilled
    alone, as the real engine's trace shows, and each TTFT counts both trips. Without them the burst
    is one prefill step."""
    from workbench.core.simulation.calibration import Calibration
    from workbench.core.trace import events as ev

    points = [
        dict(kind="decode", batch=1, context=64, measured_s=1.0, predicted_s=1.0),
        dict(kind="extend", tokens=64, batch=1, context=64, measured_s=1.0, predicted_s=1.0),
    ]
    work = [SimRequest(0.0, 64, 4) for _ in range(8)]
    prefills, results, sims = {}, {}, {}
    for trip in (False, True):
        meta = dict(tm_in_s=0.002, tm_gap_s=0.001, tm_out_s=0.003) if trip else {}
        events: list = []
        sim = Simulator(
            "llama-3.1-8b",
            "h100",
            calibration=Calibration("h100", "llama-3.1-8b", points, meta),
            trace_sink=events.extend,
        )
        results[trip], sims[trip] = sim.run(work), sim
        prefills[trip] = [e.batch_size for e in events if isinstance(e, ev.BatchStep) and e.mode == "extend"]
    assert prefills[False] == [8]
    assert prefills[True][0] == 1 and sum(prefills[True]) == 8
    lone = sims[True].cost.step([64], [64]).total
    assert results[True].ttft["r0"] == pytest.approx(0.002 + lone + 0.003)
    assert results[False].ttft["r0"] == pytest.approx(sims[False].cost.step([64] * 8, [64] * 8).total)
    assert results[True].output_tokens == results[False].output_tokens == 32


def test_a_draft_models_passes_are_costed_and_its_memory_taken():
    """speculative_draft_model (STANDALONE): each proposal of k drafts costs k decode passes of the
    draft model over the drafting requests, added to the verify pass that follows; the draft's weights
    come off the KV budget and each token keeps the draft's KV too. The scheduling is the NGRAM run's
    (same seed, same accept decisions, all requests at once): only the time differs, by exactly the
    draft passes."""
    work = [SimRequest(0.0, 200, 64) for _ in range(8)]
    kw = dict(tp_size=8, calibration=None, speculative_accept_rate=0.8, speculative_num_draft_tokens=4)
    ngram = Simulator("llama-3.1-70b", "h100", **kw)
    draft = Simulator("llama-3.1-70b", "h100", speculative_draft_model="llama-3.1-8b", **kw)
    t, d = draft.cost, draft.draft_cost
    budget = t.hw.mem_bytes * t.hw.mem_fraction - t.weight_bytes_per_rank() - d.weight_bytes_per_rank()
    want_pool = int(budget // (t.kv_bytes_per_token_per_rank() + d.kv_bytes_per_token_per_rank()))
    assert draft.runner.max_total_num_tokens == want_pool < ngram.runner.max_total_num_tokens
    plain_result, draft_result = ngram.run(work), draft.run(work)
    assert draft_result.steps == plain_result.steps and draft_result.output_tokens == plain_result.output_tokens
    drafter = draft.scheduler.drafter
    # the first proposal: 8 requests, each 200 prompt tokens + 1 sampled, 4 draft passes
    assert drafter.proposal_s[0] == pytest.approx(sum(d.step([1] * 8, [201 + j + 1] * 8).total for j in range(4)))
    assert draft.worker.busy_s - ngram.worker.busy_s == pytest.approx(sum(drafter.proposal_s))
    assert draft_result.metrics()["tpot_p50_ms"] > plain_result.metrics()["tpot_p50_ms"]
    with pytest.raises(ValueError, match="needs speculative_accept_rate"):
        Simulator("llama-3.1-70b", "h100", tp_size=8, speculative_draft_model="llama-3.1-8b")


def test_a_recorded_run_is_a_workload(tmp_path, capsys):
    """`sim run --workload FILE` takes a real engine's recording: its finished requests, at their
    arrival times, with their prompt and output lengths."""
    from workbench.core.simulation.recorded import is_recording, workload_from_trace
    from workbench.core.trace.events import ReqArrived, ReqFinished
    from workbench.core.trace.recorder import read_trace

    from workbench.cli import build_parser

    path = Path(__file__).parents[1] / "data" / "tui_trace.jsonl"
    _, events = read_trace(path)
    finished = {e.rid: e for e in events if isinstance(e, ReqFinished)}
    arrived = {e.rid: e.ts for e in events if isinstance(e, ReqArrived) and e.rid in finished}
    wl = workload_from_trace(path)
    order = sorted(arrived, key=arrived.get)
    assert len(wl) == len(finished) == 7 and is_recording(path)
    first = arrived[order[0]]
    for r, rid in zip(wl, order):
        assert r.arrival == pytest.approx((arrived[rid] - first) / 1e9)
        assert (r.prompt_len, r.output_len) == (finished[rid].prompt_tokens, finished[rid].completion_tokens)
    args = build_parser().parse_args(["sim", "run", "--model", "llama-3.1-8b", "--workload", str(path)])
    assert args.func(args) == 0
    assert "SIMULATED h100x1, llama-3.1-8b: 7 requests" in capsys.readouterr().out
    # a recording with nothing finished says what to record instead
    empty = tmp_path / "empty.jsonl"
    empty.write_text(path.read_text().splitlines()[0] + "\n")
    assert is_recording(empty) and not is_recording(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no finished requests"):
        workload_from_trace(empty)
