"""End-to-end part of tests/fast/test_simulation.py (what starts processes, engines or servers, or loads the
reference model).

Simulation at scale (issue #19): the cost model's shape, model sizes against transformers, and the
real Scheduler run over a simulated clock (every request to its exact length, the KV invariants,
simulated timestamps in the trace, determinism), and the CLI's sweep table."""

from __future__ import annotations

import re

import pytest
from tiny_models import make_tiny_llama
from workbench.core.simulation.simulator import SimRequest, Simulator


def test_a_real_run_and_its_simulation_schedule_the_same_batches(tmp_path):
    """The same scheduler code decides in both: 16 requests given at once to a real engine (a tiny
    model) and to the simulator with the same pool, chunk size and batch cap; every step's batch
    (mode; each request's prompt tokens computed and decode) is the same. Chunked prefill splits the
    prompts and the small pool forces retractions, so the steps are not trivial. (Arrivals at once:
    the step times cannot change a decision, so none need injecting.)"""
    import concurrent.futures as cf
    import random

    from pipeline_helpers import drain_events
    from reliability_helpers import wait_for
    from workbench.core.trace import events as ev

    from workbench import Engine

    d = make_tiny_llama(tmp_path / "tiny")
    rng = random.Random(4)
    lens = [(rng.randint(20, 120), rng.randint(40, 120)) for _ in range(16)]
    prompts = [[rng.randrange(10, 250) for _ in range(p)] for p, _ in lens]
    kw = dict(
        max_total_tokens=400,
        chunked_prefill_size=64,
        max_running_requests=8,
        disable_radix_cache=True,
        schedule_conservativeness=0.05,
    )

    def steps(events, name=lambda rid: rid):
        return [
            (e.mode, sorted((name(s.rid), s.computed, s.decode) for s in e.reqs))
            for e in events
            if isinstance(e, ev.BatchStep)
        ]

    real: list = []
    with Engine(model_path=str(d), dtype="float32", show_progress=False, **kw) as engine:
        sub = engine.subscribe(with_snapshot=False)
        engine.step_gate("pause")  # every request waits in the queue before the first step, as in the simulator
        with cf.ThreadPoolExecutor(1) as pool:
            done = pool.submit(
                engine.generate,
                input_ids=prompts,
                sampling_params=[{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for _, n in lens],
                rid="batch",  # request i of the batch is "batch-i-0"; the simulator calls it "ri"
            )
            wait_for(lambda: engine.get_internal_state()["num_waiting"] == len(lens), timeout=30)
            engine.step_gate("resume")
            done.result(timeout=120)
        real += drain_events(sub)
        sub.close()
    simulated: list = []
    Simulator(str(d), "cpu-here", trace_sink=simulated.extend, **kw).run([SimRequest(0.0, p, n) for p, n in lens])
    assert any(isinstance(e, ev.ReqRetracted) for e in real)
    assert steps(real, lambda rid: "r" + rid.split("-")[1]) == steps(simulated)


def test_calibrate_and_sim_accuracy_run_on_a_real_engine(tmp_path, capsys):
    """The two commands end to end on a tiny model: a calibration file from real step times, then the
    simulator beside the real engine on the same workloads (figures printed, not asserted)."""
    from workbench.core.simulation.calibration import Calibration, cpu_model

    from workbench.cli import build_parser

    d = make_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "cal.json"
    p = build_parser()
    args = p.parse_args(["bench", "calibrate", "--quick", "--model", str(d), "--dtype", "float32", "--out", str(out)])
    assert args.func(args) == 0
    cal = Calibration.load(out)
    shapes = [(pt["kind"], pt["batch"]) for pt in cal.points]
    assert shapes == [("decode", 1), ("decode", 4)] + [("extend", 1)] * 2 + [("extend", 2), ("extend", 4)]
    assert all(pt["predicted_s"] > 0 for pt in cal.points) and cal.meta["load"]
    assert all("pred_attention" in pt for pt in cal.points if pt["kind"] == "extend") and cal.extend_fit()
    trip = [cal.meta[k] for k in ("tm_in_s", "tm_gap_s", "tm_out_s")]  # the pipeline's trip, measured
    assert all(0 <= t < 1.0 for t in trip) and trip[1] > 0
    assert 0 < cal.meta["probe_s"] < 30  # the machine's pace when calibrated: sim-accuracy times it again
    assert cal.meta["cpu_model"] == cpu_model() and cal.meta["gemm_gflops"] > 0  # the machine it describes
    args = p.parse_args(
        ["bench", "sim-accuracy", "--quick", "--model", str(d), "--dtype", "float32", "--rates", "4", "--repeats", "2"]
        + ["--calibration", str(out)]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    table = [ln for ln in out.splitlines() if ln.startswith("| (") or ln.startswith("| Poisson")]
    assert len(table) == 3 and "the median of 2 runs" in out
    for row in table:  # each real figure is the median, within the range of its two runs
        cells = [c.strip() for c in row.split("|")[1:-1]]
        for cell in (cells[1], cells[4]):
            median, lo, hi = (float(x) for x in re.fullmatch(r"([\d.]+) \((\d+)-(\d+)\)", cell).groups())
            assert lo - 0.5 <= median <= hi + 0.5
        # at the machine's pace in this command (the probe now against the calibration's): a burst's
        # every pass and trip stretched by it, so its simulated throughput divides by it, TTFT multiplies
        pace = float(cells[8])
        tok_paced, ttft_paced = (float(x) for x in cells[9].split(","))
        assert 0.1 < pace < 10
        if row.startswith("| ("):
            # three figures printed to two decimals go into each comparison (CI once had 1.97 against
            # 2.0 at a pace far from 1): a few percent, where a pace not applied would be off by the pace
            assert tok_paced == pytest.approx(float(cells[3]) / pace, rel=0.03, abs=0.02)
            assert ttft_paced == pytest.approx(float(cells[6]) * pace, rel=0.03, abs=0.02 * pace)
    assert re.search(r"within 15%: \d of 6 figures as calibrated, \d at the machine's pace in this command", out)
