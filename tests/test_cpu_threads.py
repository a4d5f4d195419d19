"""The scheduler's compute-thread policy (core/model_executor/cpu_threads.py).

The decision rule and the load meter are checked on their own (fake /proc/stat, fake clock);
then a real Engine beside a real busy-loop process shows the scheduler giving the neighbour
its core, and the flags that fix the count or pin the cores.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from workbench.core.args import ServerArgs
from workbench.core.model_executor.cpu_threads import (AdaptiveThreads, CpuLoadMeter, ThreadPlan, ThreadPolicy,
                                                       cores_for_rank, parse_core_list, plan_threads)


# ---- the pure parts ------------------------------------------------------------------------------

def test_core_lists_parse_and_bad_ones_say_what_a_list_looks_like():
    assert parse_core_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_core_list(" 1, 0 ") == [0, 1]
    for bad in ("", "a", "3-1", "-1", "0-"):
        with pytest.raises(ValueError, match="like 0-3,6"):
            parse_core_list(bad)
    with pytest.raises(ValueError, match="2 core group.*3 scheduler rank"):
        cores_for_rank("0|1", 0, 3)
    assert cores_for_rank("0|1", 1, 2) == [1]


def test_policy_retreats_at_once_and_returns_only_after_quiet_windows():
    p = ThreadPolicy(2)
    assert p.observe(0.05) == 2
    assert p.observe(0.7) == 1            # a busy neighbour: down on the first window
    assert p.observe(1.0) == 1
    assert p.observe(0.25) == 1           # between the thresholds: hold, whichever way it came
    assert [p.observe(0.05) for _ in range(3)] == [1, 1, 2]     # back after three quiet windows
    assert p.observe(0.3) == 2            # below down_at: no flapping
    assert p.observe(0.05) == 2


def test_policy_counts_one_thread_per_core_taken_and_never_goes_below_one():
    p = ThreadPolicy(4)
    assert p.observe(1.6) == 2
    assert p.observe(9.0) == 1
    q = ThreadPolicy(1)
    assert q.observe(5.0) == 1 and q.observe(0.0) == 1


def test_a_quiet_window_interrupted_restarts_the_count():
    p = ThreadPolicy(2, threads=1)
    p.observe(0.0)
    p.observe(0.0)
    p.observe(0.3)                         # not quiet: the count starts over
    assert [p.observe(0.0) for _ in range(3)] == [1, 1, 2]


def _stat(cpu0: list[int], cpu1: list[int]) -> str:
    total = [a + b for a, b in zip(cpu0, cpu1)]
    return "\n".join(f"{name} " + " ".join(map(str, v)) for name, v in
                     (("cpu", total), ("cpu0", cpu0), ("cpu1", cpu1))) + "\nintr 1 2 3\n"


def test_meter_reads_other_processes_busy_time_steal_included(tmp_path):
    stat = tmp_path / "stat"
    clock = [100.0]
    own = [10.0]
    #          user nice sys idle iowait irq softirq steal
    stat.write_text(_stat([1000, 0, 100, 5000, 10, 0, 0, 0], [1000, 0, 100, 5000, 0, 0, 0, 0]))
    meter = CpuLoadMeter(cores=[0, 1], stat_path=str(stat), clock=lambda: clock[0], own_cpu=lambda: own[0])
    ticks = meter.ticks
    # One second later: 1.5 core-seconds busy on the two cores (0.2 of it steal), 0.6 of it ours.
    clock[0] += 1.0
    own[0] += 0.6
    busy = int(1.3 * ticks)
    steal = int(0.2 * ticks)
    stat.write_text(_stat([1000 + busy, 0, 100, 5000, 10, 0, 0, steal], [1000, 0, 100, 5000 + ticks, 0, 0, 0, 0]))
    assert meter.read() == pytest.approx(0.9, abs=0.02)
    # Only the cores asked about count.
    only1 = CpuLoadMeter(cores=[1], stat_path=str(stat), clock=lambda: clock[0], own_cpu=lambda: 0.0)
    clock[0] += 1.0
    assert only1.read() == pytest.approx(0.0)
    assert CpuLoadMeter(stat_path=str(tmp_path / "missing")).read() is None


def test_adaptive_threads_applies_changes_between_reads_only():
    clock = [0.0]
    readings = iter([0.8, 0.0, 0.0, 0.0])

    class FakeMeter:
        def read(self):
            return next(readings)

    applied = []
    at = AdaptiveThreads(ThreadPlan(2, True, None, "test"), apply=applied.append, interval_s=0.5,
                         meter=FakeMeter(), clock=lambda: clock[0])
    assert at.maybe_update() is None                    # before the first interval: no read
    clock[0] = 0.5
    assert at.maybe_update() == 1 and applied == [1]
    assert at.maybe_update() is None                    # same instant: no new read
    for t in (1.0, 1.5):
        clock[0] = t
        assert at.maybe_update() is None
    clock[0] = 2.0
    assert at.maybe_update() == 2 and applied == [1, 2] and len(at.changes) == 2


def test_plan_precedence(monkeypatch):
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    allowed = sorted(os.sched_getaffinity(0))
    fixed = plan_threads(3, None, 0, 1)
    assert (fixed.threads, fixed.adaptive, fixed.cores) == (3, False, None)
    pinned = plan_threads(None, str(allowed[0]), 0, 1)
    assert (pinned.threads, pinned.adaptive, pinned.cores) == (1, False, [allowed[0]])
    assert "cores " in pinned.describe()
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", str(allowed[-1]))
    assert plan_threads(None, None, 0, 1).cores == [allowed[-1]]
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND")
    shared = plan_threads(None, None, 1, 3)
    assert not shared.adaptive and shared.threads == max(1, len(allowed) // 3)
    default = plan_threads(None, None, 0, 1)
    assert default.threads == len(allowed) and default.adaptive == (len(allowed) > 1)
    assert not plan_threads(None, None, 0, 1, device="cuda").adaptive
    with pytest.raises(ValueError, match="may not use"):
        plan_threads(None, "4096", 0, 1)


def test_server_args_refuse_bad_thread_flags():
    with pytest.raises(ValueError, match="at least 1"):
        ServerArgs(num_threads=0)
    with pytest.raises(ValueError, match="like 0-3,6"):
        ServerArgs(cpu_omp_threads_bind="zero")
    with pytest.raises(ValueError, match="one group each"):
        ServerArgs(cpu_omp_threads_bind="0|1")
    ServerArgs(cpu_omp_threads_bind="0-1")


# ---- a real engine beside a real neighbour ------------------------------------------------------

def _busy_loop(stop) -> None:
    while not stop.is_set():
        pass


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the adaptive policy needs at least 2 cores")
def test_engine_gives_a_busy_neighbour_its_core(default_prepared):
    from workbench import Engine
    with Engine(dtype="float32", max_total_tokens=2048, show_progress=False) as engine:
        assert "adaptive" in engine.scheduler_info["threads"]
        cores = len(os.sched_getaffinity(0))
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        hogs = [ctx.Process(target=_busy_loop, args=(stop,), daemon=True) for _ in range(cores - 1)]
        for h in hogs:
            h.start()
        try:
            deadline = time.monotonic() + 30
            state = engine.get_internal_state()
            while state["num_threads"] != 1 and time.monotonic() < deadline:
                time.sleep(0.25)
                state = engine.get_internal_state()
            assert state["num_threads"] == 1, state
            assert state["others_load"] > 0.35
            # It keeps serving, with one thread, while the neighbours run.
            out = engine.generate(input_ids=[1, 2, 3, 4], sampling_params={"max_new_tokens": 4,
                                                                           "temperature": 0.0})
            assert len(out["output_ids"]) == 4
        finally:
            stop.set()
            for h in hogs:
                h.join(10)


def test_fixed_threads_stay_fixed(default_prepared):
    from workbench import Engine
    with Engine(dtype="float32", max_total_tokens=2048, num_threads=1, show_progress=False) as engine:
        assert "fixed" in engine.scheduler_info["threads"] and "--num-threads" in engine.scheduler_info["threads"]
        time.sleep(1.2)
        state = engine.get_internal_state()
        assert state["num_threads"] == 1 and state["others_load"] == -1.0
