"""Priority scheduling (--enable-priority-scheduling), in-process: the real Scheduler, the stand-in model.

A late request of higher priority is admitted before queued ones of lower priority; where no slot
or no KV room is left, it preempts running requests whose priority is worse by more than
--priority-scheduling-preemption-threshold. A preempted request is prefilled again later and still
finishes with exactly the tokens of an uninterrupted run (`expected_tokens`), and the KV invariant
check passes after every step (the harness runs it).
"""

from __future__ import annotations

import random

import pytest
from scheduler_harness import SchedulerHarness, expected_tokens
from workbench.core.managers.schedule_policy import least_urgent_priority
from workbench.core.trace import events as ev
from workbench.core.trace.views import format_priority

BOTH_LOOPS = pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [3 + (seed * 7919) % 900] + [rng.randrange(3, 900) for _ in range(n - 1)]


def first_extends(h: SchedulerHarness) -> list[str]:
    seen: list[str] = []
    for reqs in h.extend_batches():
        for rid, _ in reqs:
            if rid not in seen:
                seen.append(rid)
    return seen


def assert_full_outputs(h: SchedulerHarness, prompts: dict, n: dict) -> None:
    for rid, p in prompts.items():
        assert h.tokens(rid) == expected_tokens(p, n[rid]), rid
        assert h.finish[rid] == "length", rid


def harness(**kw) -> SchedulerHarness:
    kw.setdefault("enable_priority_scheduling", True)
    return SchedulerHarness(**kw)


# ==== admission order ===========================================================================
@pytest.mark.parametrize("policy", ["fcfs", "lpm", "lof"])
def test_late_high_priority_request_overtakes_queued_low_priority_ones(policy):
    # One running slot and a threshold no difference exceeds: ordering only, no preemption.
    h = harness(max_running_requests=1, priority_scheduling_preemption_threshold=1000, schedule_policy=policy)
    prompts = {rid: prompt(i, 12) for i, rid in enumerate(["a", "b", "c", "urgent"])}
    n = {rid: 3 for rid in prompts}
    h.submit("a", prompts["a"], 3, priority=0)
    h.step()  # a runs
    for rid in ("b", "c"):
        h.submit(rid, prompts[rid], 3, priority=0)
    h.step()
    h.submit("urgent", prompts["urgent"], 3, priority=10)
    h.run_until_idle()
    assert first_extends(h) == ["a", "urgent", "b", "c"]
    assert not h.trace(ev.ReqRetracted)
    assert_full_outputs(h, prompts, n)
    h.assert_idle_and_clean()


def test_without_priority_scheduling_a_priority_is_ignored():
    # SGLang's rule: a request's priority on a server without --enable-priority-scheduling has no effect.
    h = SchedulerHarness(max_running_requests=1)
    prompts = {rid: prompt(i, 12) for i, rid in enumerate(["a", "b", "urgent"])}
    h.submit("a", prompts["a"], 3, priority=0)
    h.step()
    h.submit("b", prompts["b"], 3, priority=0)
    h.submit("urgent", prompts["urgent"], 3, priority=100)
    h.run_until_idle()
    assert first_extends(h) == ["a", "b", "urgent"]
    assert not h.trace(ev.ReqRetracted)
    assert [e.priority for e in h.trace(ev.ReqQueued)] == [None, None, None]
    assert_full_outputs(h, prompts, {rid: 3 for rid in prompts})


def test_low_priority_values_first_flips_the_order_and_unset_is_least_urgent():
    h = harness(
        max_running_requests=1, schedule_low_priority_values_first=True, priority_scheduling_preemption_threshold=1000
    )
    prompts = {rid: prompt(i, 12) for i, rid in enumerate(["a", "big", "none", "small"])}
    h.submit("a", prompts["a"], 3, priority=5)
    h.step()
    h.submit("big", prompts["big"], 3, priority=10)
    h.submit("none", prompts["none"], 3)  # no priority: after everyone that has one
    h.submit("small", prompts["small"], 3, priority=1)
    h.run_until_idle()
    assert first_extends(h) == ["a", "small", "big", "none"]
    queued = {e.rid: e.priority for e in h.trace(ev.ReqQueued)}
    assert queued == {"a": 5, "big": 10, "none": least_urgent_priority(True), "small": 1}
    assert format_priority(queued["none"]) == "unset"
    assert_full_outputs(h, prompts, {rid: 3 for rid in prompts})


# ==== preemption ================================================================================
@BOTH_LOOPS
def test_no_running_slot_preempts_a_lower_priority_request_which_finishes_in_full(overlap):
    h = harness(max_running_requests=2, priority_scheduling_preemption_threshold=5, overlap=overlap)
    prompts = {"low1": prompt(1, 16), "low2": prompt(2, 20), "high": prompt(3, 14)}
    n = {"low1": 12, "low2": 12, "high": 4}
    h.submit("low1", prompts["low1"], n["low1"], priority=0)
    h.submit("low2", prompts["low2"], n["low2"], priority=2)
    for _ in range(4):
        h.step()  # both prefilled and decoding
    h.submit("high", prompts["high"], n["high"], priority=10)
    h.step()
    retracted = h.trace(ev.ReqRetracted)
    # The least urgent running request (priority 0) gives up its slot; the other keeps running.
    assert [e.rid for e in retracted] == ["low1"]
    assert retracted[0].reason == "preempted low1 (priority 0) for high (priority 10)"
    assert retracted[0].priority == 0 and retracted[0].output_tokens > 0
    assert "high" in [rid for reqs in h.extend_batches()[-1:] for rid, _ in reqs]
    h.run_until_idle()
    decisions = [d for d in h.trace(ev.StepDecision) if d.preemptions]
    assert [d.preemptions for d in decisions] == [["preempted low1 (priority 0) for high (priority 10)"]]
    assert "low1" in decisions[0].retracted
    assert h.s.priority.num_preempted_total == 1 and h.s.priority.preempted_by_priority == {"0": 1}
    # The preempted request is prefilled again over its prompt and the tokens it had, and its output
    # equals an uninterrupted run's.
    assert_full_outputs(h, prompts, n)
    h.assert_idle_and_clean()


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
@BOTH_LOOPS
def test_kv_pool_too_small_for_both_preempts_the_running_request(overlap, radix):
    # 100 KV slots: a 40-token prompt that will decode 30, then a 40-token prompt wanting 20 more:
    # both do not fit, so the late urgent one preempts the running one.
    h = harness(
        max_total_tokens=100,
        priority_scheduling_preemption_threshold=0,
        overlap=overlap,
        disable_radix_cache=not radix,
    )
    prompts = {"low": prompt(7, 40), "high": prompt(8, 40)}
    n = {"low": 30, "high": 20}
    h.submit("low", prompts["low"], n["low"], priority=1)
    for _ in range(5):
        h.step()
    h.submit("high", prompts["high"], n["high"], priority=2)
    h.step()
    retracted = h.trace(ev.ReqRetracted)
    assert [e.rid for e in retracted] == ["low"]
    assert retracted[0].reason == "preempted low (priority 1) for high (priority 2)"
    h.run_until_idle()
    # high ran to completion first, then low came back and finished.
    finished_order = list(h.finish)  # in the order they finished
    assert finished_order == ["high", "low"]
    assert_full_outputs(h, prompts, n)
    h.assert_idle_and_clean()


@pytest.mark.parametrize("diff,preempts", [(5, False), (6, True)])
def test_threshold_is_respected(diff, preempts):
    # Preemption needs the difference to be MORE than the threshold (5): 5 is not enough, 6 is.
    h = harness(max_running_requests=1, priority_scheduling_preemption_threshold=5)
    prompts = {"low": prompt(11, 12), "high": prompt(12, 12)}
    n = {"low": 10, "high": 3}
    h.submit("low", prompts["low"], n["low"], priority=0)
    for _ in range(3):
        h.step()
    h.submit("high", prompts["high"], n["high"], priority=diff)
    h.run_until_idle()
    assert [e.rid for e in h.trace(ev.ReqRetracted)] == (["low"] if preempts else [])
    assert list(h.finish) == (["high", "low"] if preempts else ["low", "high"])
    assert_full_outputs(h, prompts, n)
    h.assert_idle_and_clean()


def test_low_values_first_preempts_the_larger_value():
    h = harness(
        max_running_requests=1, schedule_low_priority_values_first=True, priority_scheduling_preemption_threshold=0
    )
    prompts = {"low": prompt(21, 12), "high": prompt(22, 12)}
    n = {"low": 10, "high": 3}
    h.submit("low", prompts["low"], n["low"], priority=9)
    for _ in range(3):
        h.step()
    h.submit("high", prompts["high"], n["high"], priority=1)
    h.run_until_idle()
    assert [e.reason for e in h.trace(ev.ReqRetracted)] == ["preempted low (priority 9) for high (priority 1)"]
    assert_full_outputs(h, prompts, n)
    h.assert_idle_and_clean()


def test_a_request_is_not_preempted_when_even_all_candidates_would_not_make_room():
    # The urgent request needs more KV than the low-priority one holds and will hold: SGLang preempts
    # no one then (the request waits for room as usual).
    h = harness(max_total_tokens=100, priority_scheduling_preemption_threshold=0)
    prompts = {"mid": prompt(31, 40), "low": prompt(32, 10), "high": prompt(33, 40)}
    n = {"mid": 20, "low": 8, "high": 20}
    h.submit("mid", prompts["mid"], n["mid"], priority=5)  # as urgent as... more than high: not preemptible
    h.submit("low", prompts["low"], n["low"], priority=0)
    for _ in range(3):
        h.step()
    h.submit("high", prompts["high"], n["high"], priority=5)
    h.step()
    assert not h.trace(ev.ReqRetracted)
    h.run_until_idle()
    assert_full_outputs(h, prompts, n)
    h.assert_idle_and_clean()


# ==== views ======================================================================================
def test_narration_queues_and_snapshot_show_priorities_and_the_preemption():
    from workbench.core.trace.state import TraceState
    from workbench.tui.model import TuiModel
    from workbench.tui.panels.queues import queue_rows

    h = harness(max_running_requests=1, priority_scheduling_preemption_threshold=0)
    h.submit("low", prompt(41, 12), 10, priority=1)
    for _ in range(3):
        h.step()
    h.submit("high", prompt(42, 12), 3, priority=7)
    h.step()
    m = TuiModel()
    m.apply(h.events)
    st = m.state
    line = st.narrate(st.steps[-1])
    assert "preempted low (priority 1) for high (priority 7)" in line and "retracted" not in line
    assert st.requests["low"].priority == 1 and st.requests["high"].priority == 7
    timeline = [t.detail for t in st.requests["low"].timeline if t.kind == "retracted"]
    assert timeline == ["preempted low (priority 1) for high (priority 7), after 3 output tokens"]
    rows = dict(queue_rows(m))
    assert str(rows["high"][1]) == "high p7" and str(rows["low"][1]) == "low p1"
    assert rows["low"][2].startswith("preempted for high")
    late = TraceState()  # a late subscriber's snapshot keeps both
    late.apply_many(st.snapshot_events())
    assert late.requests["low"].priority == 1 and late.requests["low"].preempted.startswith("preempted low")
    h.run_until_idle()


def test_metrics_count_priority_preemptions_by_priority():
    from workbench.core.entrypoints.metrics import ServerMetrics

    h = harness(max_running_requests=1, priority_scheduling_preemption_threshold=0)
    h.submit("low", prompt(51, 12), 10, priority=1)
    for _ in range(3):
        h.step()
    h.submit("high", prompt(52, 12), 3, priority=7)
    h.run_until_idle()
    m = ServerMetrics("m")
    m.on_events(h.events)
    text = m.render().decode()
    assert 'sglang:num_priority_preempted_reqs_total{model_name="m",priority="1"} 1.0' in text
    assert "sglang:num_retracted_reqs" in text


# ==== the simulator ==============================================================================
def test_simulator_models_priorities_with_the_real_scheduler():
    from workbench.core.simulation.simulator import Simulator, parse_priority_mix, poisson_workload

    mix = parse_priority_mix("10:0.2,0:0.8")
    assert mix == [(10, 0.2), (0, 0.8)]
    work = poisson_workload(40, 120, (128, 512), (32, 96), seed=3, priority_mix=mix)
    plain = poisson_workload(40, 120, (128, 512), (32, 96), seed=3)
    # the same arrivals and lengths with or without priorities
    assert [(w.arrival, w.prompt_len, w.output_len) for w in work] == [
        (w.arrival, w.prompt_len, w.output_len) for w in plain
    ]
    assert {w.priority for w in work} == {0, 10}
    res = Simulator(
        "llama-3.1-8b",
        "h100",
        max_running_requests=8,
        enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=5,
    ).run(work)
    assert len(res.latency) == 120 and res.preempted > 0 and res.retracted >= res.preempted
    urgent = {rid: v for rid, v in res.ttft.items() if res.priority_of[rid] == 10}
    others = {rid: v for rid, v in res.ttft.items() if res.priority_of[rid] == 0}
    assert res._pct(urgent, 0.5) < res._pct(others, 0.5) / 5
    assert "TTFT p50 by priority 10:" in res.summary() and "preempted" in res.summary()
    with pytest.raises(ValueError, match="PRIORITY:SHARE"):
        parse_priority_mix("high:1")


# ==== the request path ===========================================================================
def test_engine_priority_is_one_value_or_one_per_prompt():
    from workbench.core.engine import _priority_per_prompt

    assert _priority_per_prompt(None, 2) == [None, None]
    assert _priority_per_prompt(5, 3) == [5, 5, 5]
    assert _priority_per_prompt([1, None], 2) == [1, None]
    with pytest.raises(ValueError, match="one per prompt"):
        _priority_per_prompt([1, 2, 3], 2)
    with pytest.raises(ValueError, match="integer"):
        _priority_per_prompt("high", 1)


def test_openai_and_native_bodies_take_priority():
    from workbench.core.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerateReqInput

    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "priority": 3})
    assert chat.priority == 3
    assert CompletionRequest.model_validate({"prompt": "x", "priority": -2}).priority == -2
    assert GenerateReqInput.model_validate({"text": ["a", "b"], "priority": [1, 2]}).priority == [1, 2]


def test_the_notebook_request_details_show_priority_and_preemption():
    pytest.importorskip("ipywidgets")
    from workbench.core.trace.state import TraceState
    from workbench.widgets import data as D
    from workbench.widgets import views as V

    h = harness(max_running_requests=1, priority_scheduling_preemption_threshold=0)
    h.submit("low", prompt(61, 12), 8, priority=1)
    for _ in range(3):
        h.step()
    h.submit("high", prompt(62, 12), 2, priority=4)
    h.run_until_idle()
    st = TraceState()
    st.apply_many(h.events)
    d = D.request_details(st, "low")
    assert d["priority"] == 1 and d["preempted"] == "preempted low (priority 1) for high (priority 4)"
    html_text = V.details_html(st, "low")
    assert "<b>priority</b> 1" in html_text and "preempted low (priority 1) for high" in html_text


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@BOTH_LOOPS
def test_random_workloads_with_priorities_finish_every_request_in_full(overlap, seed):
    # Arrivals spread over steps, priorities 0..20, a small pool and few slots: admissions, KV retractions
    # and priority preemptions interleave; every request still ends with its reference tokens, the KV
    # check passes after every step (the harness) and nothing is left held.
    rng = random.Random(seed)
    h = harness(
        max_total_tokens=220,
        max_running_requests=3,
        priority_scheduling_preemption_threshold=rng.choice([0, 5]),
        schedule_low_priority_values_first=bool(seed % 2),
        schedule_policy=["fcfs", "lpm", "lof"][seed % 3],
        chunked_prefill_size=[-1, 16][seed % 2],
        overlap=overlap,
    )
    prompts, n, plan = {}, {}, []
    for i in range(12):
        rid = f"r{i}"
        prompts[rid] = prompt(100 * seed + i, rng.randint(8, 40))
        n[rid] = rng.randint(2, 24)
        plan.append((rng.randint(0, 30), rid, rng.randint(0, 20)))
    plan.sort()
    step = 0
    while plan or h.s.has_work():
        while plan and plan[0][0] <= step:
            _, rid, prio = plan.pop(0)
            h.submit(rid, prompts[rid], n[rid], priority=prio)
        h.step()
        step += 1
        assert step < 2000
    h.run_until_idle()
    assert h.s.priority.num_preempted_total > 0  # the workload does exercise preemption
    assert_full_outputs(h, prompts, n)
    h.assert_idle_and_clean()
