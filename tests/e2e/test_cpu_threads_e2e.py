"""End-to-end part of tests/fast/test_cpu_threads.py (what starts processes, engines or servers, or loads the
reference model).

The scheduler's compute-thread policy (core/model_executor/cpu_threads.py).

The decision rule and the load meter are checked on their own (fake /proc/stat, fake clock);
then a real Engine beside a real busy-loop process shows the scheduler giving the neighbour
its core, and the flags that fix the count or pin the cores.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from workbench.core.model_executor.cpu_threads import (
    OMP_SPINCOUNT,
)

# ---- a real engine beside a real neighbour ------------------------------------------------------


def _busy_loop(stop) -> None:
    while not stop.is_set():
        pass


def _environ_of(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)


def test_engine_probes_thread_counts_beside_a_busy_neighbour_and_keeps_serving(default_prepared, hf_model):
    """Real scheduler, real neighbours: it measures (probes) and its tokens stay transformers' tokens."""
    from conftest import hf_greedy

    from workbench import Engine

    prompt = [1, 504, 3003, 2380, 281, 260]
    with Engine(dtype="float32", max_total_tokens=2048, show_progress=False) as engine:
        assert "adaptive" in engine.scheduler_info["threads"]
        # the scheduler was started with the bounded OpenMP spin, and says so; this process was not changed
        assert f"spin {OMP_SPINCOUNT} rounds" in engine.scheduler_info["threads"]
        if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
            assert _environ_of(engine.procs["scheduler"].pid).get("GOMP_SPINCOUNT") == OMP_SPINCOUNT
        cores = len(os.sched_getaffinity(0))
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        hogs = [ctx.Process(target=_busy_loop, args=(stop,), daemon=True) for _ in range(cores - 1)]
        for h in hogs:
            h.start()
        try:
            out = engine.generate(
                input_ids=prompt, sampling_params={"max_new_tokens": 120, "temperature": 0.0, "ignore_eos": True}
            )
            time.sleep(0.6)
            state = engine.get_internal_state()
        finally:
            stop.set()
            for h in hogs:
                h.join(10)
    assert state["thread_probes"] >= 1, state
    assert 1 <= state["num_threads"] <= cores
    assert state["others_load"] > 0.3, state  # the neighbour is seen
    assert out["output_ids"] == hf_greedy(hf_model, prompt, 120)


def test_fixed_threads_stay_fixed(default_prepared):
    from workbench import Engine

    with Engine(dtype="float32", max_total_tokens=2048, num_threads=1, show_progress=False) as engine:
        assert "fixed" in engine.scheduler_info["threads"] and "--num-threads" in engine.scheduler_info["threads"]
        time.sleep(1.2)
        state = engine.get_internal_state()
        assert state["num_threads"] == 1 and state["others_load"] == -1.0
