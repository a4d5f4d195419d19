"""The scheduler's compute-thread policy (core/model_executor/cpu_threads.py).

The decision rule and the load meter are checked on their own (fake /proc/stat, fake clock);
then a real Engine beside a real busy-loop process shows the scheduler giving the neighbour
its core, and the flags that fix the count or pin the cores.

The end-to-end tests of this module are in tests/e2e/test_cpu_threads_e2e.py.
"""

from __future__ import annotations

import argparse
import os

import pytest
from workbench.core.args import ServerArgs
from workbench.core.model_executor.cpu_threads import (
    OMP_SPINCOUNT,
    AdaptiveThreads,
    CpuLoadMeter,
    StepTimePolicy,
    ThreadPlan,
    cores_for_rank,
    omp_wait_env,
    omp_wait_text,
    omp_wait_values,
    overlap_by_default,
    parse_core_list,
    plan_threads,
)

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


def _run(policy: StepTimePolicy, bs: int, ms_at: dict, steps: int) -> list[int]:
    """Feed `steps` decode steps whose time depends on the thread count; returns the counts used."""
    used = []
    for _ in range(steps):
        n = policy.current
        used.append(n)
        policy.observe_decode(bs, ms_at[n])
    return used


def test_policy_keeps_the_faster_count_after_a_probe():
    p = StepTimePolicy(2, period=8, probe_steps=4)
    used = _run(p, 32, {2: 100.0, 1: 60.0}, 12)  # one thread is faster (a busy neighbour)
    assert used[:8] == [2] * 8 and used[8:12] == [1] * 4
    assert p.threads == 1 and p.probes == 1
    used = _run(p, 32, {2: 100.0, 1: 60.0}, 12)  # it tries 2 again and stays with 1
    assert 2 in used and p.threads == 1 and p.current == 1


def test_first_probe_comes_early_then_every_period():
    p = StepTimePolicy(2)  # defaults: first after 8 steps, then every 48
    used = _run(p, 4, {2: 50.0, 1: 80.0}, 8 + 4 + 48 + 4)
    assert used[:8] == [2] * 8 and used[8] == 1  # the early probe: a collapsing start is short
    assert used[12:60] == [2] * 48 and used[60] == 1 and p.probes == 2 and p.threads == 2


def test_policy_keeps_two_threads_when_they_are_faster_and_ignores_small_gains():
    p = StepTimePolicy(2, period=8, probe_steps=4)
    _run(p, 8, {2: 50.0, 1: 80.0}, 40)
    assert p.threads == 2 and p.probes >= 3
    q = StepTimePolicy(2, period=8, probe_steps=4, margin=0.08)
    _run(q, 8, {2: 50.0, 1: 48.0}, 12)  # 4% faster: inside the margin, no switch
    assert q.threads == 2


def test_a_collapsing_probe_costs_one_slow_step():
    p = StepTimePolicy(1, period=8, probe_steps=4, threads=1)
    p.max_threads = 2
    used = _run(p, 1, {1: 20.0, 2: 200.0}, 10)  # two threads collapse (a spinning team): 10x
    assert used[8] == 2 and used[9] == 1  # even the untimed first step shows a collapse that deep
    assert p.threads == 1 and p.probing is None
    q = StepTimePolicy(2, period=8, probe_steps=4, threads=1)
    used = _run(q, 1, {1: 20.0, 2: 50.0}, 11)  # 2.5x: the untimed step may be a wake-up, the next one tells
    assert used[8:10] == [2, 2] and used[10] == 1 and q.threads == 1


def test_failed_probes_up_back_off_and_a_kept_one_resets():
    """Beside a busy neighbour every probe of two threads fails: each doubles the wait before the
    next (8, 16, 32, 64, 64 steps here), so a long run pays a few slow steps, not one per period."""
    p = StepTimePolicy(2, period=8, probe_steps=4, max_backoff=8)
    used = _run(p, 1, {2: 200.0, 1: 20.0}, 8 + 4)  # starts at 2, probes 1 at step 8, keeps it
    assert p.threads == 1
    used = _run(p, 1, {2: 200.0, 1: 20.0}, 8 + 1 + 16 + 1 + 32 + 1 + 64 + 1 + 64 + 1)
    ups = [i for i, n in enumerate(used) if n == 2]
    assert ups == [8, 25, 58, 123, 188] and p.threads == 1
    _run(p, 1, {2: 10.0, 1: 20.0}, 64 + 4)  # the neighbour left: the next probe up is kept
    assert p.threads == 2 and p._up_backoff == 1


def test_a_long_back_off_is_bounded_in_time():
    """At a large batch a period of steps is many seconds: the wait for a probe up never passes
    max_wait_ms of decoding, whatever the back-off."""
    p = StepTimePolicy(2, period=8, probe_steps=4, max_wait_ms=1000.0, threads=1)
    p._up_backoff = 16
    used = _run(p, 32, {1: 100.0, 2: 300.0}, 12)
    assert used.index(2) == 10  # 8 steps (the period), then 1000 ms: steps 9 and 10 at 100 ms


def test_a_probe_ends_when_the_batch_changes_and_retries_soon():
    p = StepTimePolicy(2, period=8, probe_steps=4)
    _run(p, 32, {2: 100.0, 1: 60.0}, 9)
    assert p.probing == 1
    p.observe_decode(31, 60.0)  # a request finished: not comparable
    assert p.probing is None and p.threads == 2
    _run(p, 31, {2: 100.0, 1: 60.0}, 8)  # half a period later it tries again
    assert p.threads == 1


def test_more_cores_try_one_step_either_way():
    p = StepTimePolicy(4, period=4, probe_steps=3, threads=2)
    seen = set()
    for _ in range(40):
        seen.add(p.current)
        p.observe_decode(16, {1: 90.0, 2: 50.0, 3: 70.0, 4: 70.0}[p.current])
    assert {1, 3} <= seen and p.threads == 2


def _stat(cpu0: list[int], cpu1: list[int]) -> str:
    total = [a + b for a, b in zip(cpu0, cpu1)]
    return (
        "\n".join(f"{name} " + " ".join(map(str, v)) for name, v in (("cpu", total), ("cpu0", cpu0), ("cpu1", cpu1)))
        + "\nintr 1 2 3\n"
    )


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


def test_adaptive_threads_applies_probes_and_reports_the_neighbours():
    clock = [0.0]

    class FakeMeter:
        def read(self):
            return 0.8

    applied = []
    at = AdaptiveThreads(
        ThreadPlan(2, True, None, "test"),
        apply=applied.append,
        interval_s=0.5,
        meter=FakeMeter(),
        clock=lambda: clock[0],
        policy=StepTimePolicy(2, period=4, probe_steps=3),
    )
    for i in range(7):
        clock[0] = i * 0.3
        at.on_decode_step(4, 60.0 if at.policy.current == 1 else 100.0)
    assert applied == [1] and at.threads == 1 and len(at.changes) == 1
    assert at.others == 0.8


def test_asked_probe_starts_without_waiting_for_the_period():
    p = StepTimePolicy(2, period=48, first_probe=48, probe_steps=4)
    _run(p, 1, {2: 100.0, 1: 60.0}, 10)
    assert p.probes == 0
    assert p.probe_soon(1)
    used = _run(p, 1, {2: 100.0, 1: 60.0}, 8)
    assert used == [2] * 4 + [1] * 4 and p.threads == 1  # a fresh baseline of 4 steps, then the probe, kept
    assert not p.probe_soon(1) and not p.probe_soon(3) and not p.probe_soon(0)  # current / out of range
    p._up_backoff = 8
    assert p.probe_soon(2) and p._up_backoff == 1  # asking up forgets the back-off
    used = _run(p, 1, {2: 50.0, 1: 60.0}, 8)
    assert used == [1] * 4 + [2] * 4 and p.threads == 2


def test_load_meter_triggers_a_probe_when_a_neighbour_arrives_and_when_it_leaves():
    """The meter asks for a probe when the neighbours' use moves half a core; a steady neighbour
    asks once; the step times still decide (a probe that is slower is not kept)."""
    clock = [0.0]
    load = [0.1]

    class FakeMeter:
        def read(self):
            return load[0]

    at = AdaptiveThreads(
        ThreadPlan(2, True, None, "test"),
        apply=lambda n: None,
        interval_s=0.25,
        meter=FakeMeter(),
        clock=lambda: clock[0],
        policy=StepTimePolicy(2, period=48, first_probe=48, probe_steps=4),
    )
    speed = {2: 40.0, 1: 60.0}  # quiet: two threads are faster

    def steps(n):
        used = []
        for _ in range(n):
            clock[0] += 0.1
            used.append(at.policy.current)
            at.on_decode_step(1, speed[at.policy.current])
        return used

    steps(20)
    assert at.triggers == 0 and at.threads == 2
    load[0] = 1.0  # a busy loop arrives; two threads collapse
    speed = {2: 120.0, 1: 45.0}
    used = steps(12)
    assert at.triggers == 1 and at.threads == 1 and used.index(1) <= 8  # not 48 steps later
    steps(30)
    assert at.triggers == 1  # it stays: no further trigger
    load[0] = 0.1  # it leaves
    speed = {2: 40.0, 1: 60.0}
    used = steps(12)
    assert at.triggers == 2 and at.threads == 2 and used.index(2) <= 8
    load[0] = 0.7  # something that does not make one thread faster: probed, not kept
    steps(12)
    assert at.triggers == 3 and at.threads == 2


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


def test_overlap_loop_by_default_only_beside_a_spare_core(monkeypatch):
    """Undecided, the overlap loop runs on CPU only when a fixed thread count leaves a core idle."""
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("workbench.core.model_executor.cpu_threads._allowed_cores", lambda: {0, 1, 2, 3})
    one = plan_threads(1, None, 0, 1)
    assert one.spare_cores == 3 and overlap_by_default(one, "cpu")
    assert not overlap_by_default(one, "cuda") and not overlap_by_default(one, "cpu", dp_size=2)
    every = plan_threads(4, None, 0, 1)
    assert every.spare_cores == 0 and not overlap_by_default(every, "cpu")
    assert plan_threads(8, None, 0, 1).spare_cores == 0  # oversubscribed: nothing spare
    assert not overlap_by_default(plan_threads(None, None, 0, 1), "cpu")  # adaptive uses every core it can
    two_ranks = plan_threads(1, None, 1, 2)  # TP 2 on this node: each rank's share is two cores
    assert two_ranks.spare_cores == 1 and overlap_by_default(two_ranks, "cpu")
    assert not overlap_by_default(plan_threads(2, None, 0, 2), "cpu")
    pinned = plan_threads(1, "0-1", 0, 1)  # a core list bounds the room
    assert pinned.spare_cores == 1 and overlap_by_default(pinned, "cpu")


def test_overlap_flag_has_three_states():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args([]).disable_overlap_schedule is None
    assert parser.parse_args(["--disable-overlap-schedule"]).disable_overlap_schedule is True
    assert parser.parse_args(["--no-disable-overlap-schedule"]).disable_overlap_schedule is False


def test_server_args_refuse_bad_thread_flags():
    with pytest.raises(ValueError, match="at least 1"):
        ServerArgs(num_threads=0)
    with pytest.raises(ValueError, match="like 0-3,6"):
        ServerArgs(cpu_omp_threads_bind="zero")
    with pytest.raises(ValueError, match="one group each"):
        ServerArgs(cpu_omp_threads_bind="0|1")
    ServerArgs(cpu_omp_threads_bind="0-1")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the adaptive policy needs at least 2 cores")
def test_omp_wait_env_bounds_the_spin_unless_the_user_chose(monkeypatch):
    for var in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(var, raising=False)
    assert omp_wait_values({}) == {"GOMP_SPINCOUNT": OMP_SPINCOUNT}
    assert omp_wait_values({"OMP_WAIT_POLICY": "ACTIVE"}) == {} and omp_wait_values({"GOMP_SPINCOUNT": "5"}) == {}
    with omp_wait_env("cpu") as added:  # set for children started inside, restored after
        assert added == {"GOMP_SPINCOUNT": OMP_SPINCOUNT} and os.environ["GOMP_SPINCOUNT"] == OMP_SPINCOUNT
    assert "GOMP_SPINCOUNT" not in os.environ
    with omp_wait_env("cuda") as added:
        assert added == {} and "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with omp_wait_env("cpu") as added:
        assert added == {} and "GOMP_SPINCOUNT" not in os.environ
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert omp_wait_text({"GOMP_SPINCOUNT": "10000"}) == "OpenMP waits: spin 10000 rounds, then sleep"
    assert "OMP_WAIT_POLICY=PASSIVE" in omp_wait_text({"OMP_WAIT_POLICY": "PASSIVE"})
    assert "default" in omp_wait_text({})
