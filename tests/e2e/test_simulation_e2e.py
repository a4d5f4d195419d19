"""End-to-end part of tests/fast/test_simulation.py (what starts processes, engines or servers, or loads the
reference model).

Simulation at scale (issue #19): the cost model's shape, model sizes against transformers, and the
real Scheduler run over a simulated clock (every request to its exact length, the KV invariants,
simulated timestamps in the trace, determinism), and the CLI's sweep table."""

from __future__ import annotations

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
