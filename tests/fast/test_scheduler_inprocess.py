"""Scheduling behaviour, in-process: the real Scheduler, a stand-in model, a list for I/O.

No processes, no model weights: every test runs in milliseconds (tests/scheduler_harness.py).
The stand-in model reads its context back through the KV slots the scheduler assigned, so every
test also checks that the tokens equal `expected_tokens` (the same rule over a plain list), and the
harness runs `Scheduler.check_kv_invariants()` after every step. Each test states the behaviour as a
small expected model: the order requests are admitted in, the extend lengths of each step, who is
running, who is held back, what is locked.
"""

from __future__ import annotations

import random

import pytest
from scheduler_harness import SchedulerHarness, expected_tokens
from workbench.core.io_struct import (
    AbortReq,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    StepGateReq,
    StepGateReqOutput,
)
from workbench.core.managers.schedule_policy import IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD as THRESHOLD
from workbench.core.managers.scheduler_kv_check import KV_CHECK_ENV, KVInvariantError
from workbench.core.trace import events as ev

BOTH_LOOPS = pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])


def prompt(seed: int, n: int, start: list[int] = ()) -> list[int]:
    """`start` + random tokens up to `n` (distinct seeds give distinct tokens right after `start`)."""
    rng = random.Random(seed)
    out = list(start) + [3 + (seed * 7919) % 900]
    return out + [rng.randrange(3, 900) for _ in range(n - len(out))]


def first_extends(h: SchedulerHarness) -> list[str]:
    """Request ids in the order of their first extend pass."""
    seen = []
    for reqs in h.extend_batches():
        for rid, _ in reqs:
            if rid not in seen:
                seen.append(rid)
    return seen


def assert_reference(h: SchedulerHarness, prompts: dict, n) -> None:
    for rid, p in prompts.items():
        want = n[rid] if isinstance(n, dict) else n
        assert h.tokens(rid) == expected_tokens(p, want), rid
        assert h.finish[rid] == "length", rid


# ==== admission order per policy ===========================================================
def test_fcfs_admits_in_arrival_order():
    h = SchedulerHarness(max_running_requests=1)
    prompts = {f"r{i}": prompt(i, 20 + 5 * (4 - i)) for i in range(4)}
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=3)
    h.run_until_idle()
    assert first_extends(h) == ["r0", "r1", "r2", "r3"]
    # One running request at a time: each one's prefill and 2 decodes, then the next.
    assert [mode for mode, _ in h.batches] == ["extend", "decode", "decode"] * 4
    assert_reference(h, prompts, 3)
    h.assert_idle_and_clean()


@pytest.mark.parametrize("policy, order", [("fcfs", ["a", "b", "c"]), ("lpm", ["c", "b", "a"])])
def test_policy_orders_the_queue(policy, order):
    """lpm: the longest cached prefix first; fcfs: arrival order. Same queue, same cache."""
    h = SchedulerHarness(max_running_requests=1, schedule_policy=policy)
    base = prompt(100, 200)
    h.submit("warm", base, max_new_tokens=1)
    h.run_until_idle()
    prompts = {"a": prompt(1, 150), "b": prompt(2, 150, base[:60]), "c": prompt(3, 150, base[:120])}
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=2)
    h.run_until_idle()
    assert first_extends(h)[1:] == order
    assert h.cached == {"warm": 0, "a": 0, "b": 60, "c": 120}
    # The cache served the prefix: each first extend computed only the rest.
    firsts = {rid: n for reqs in h.extend_batches() for rid, n in reqs}
    assert firsts["b"] == 150 - 60 and firsts["c"] == 150 - 120 and firsts["a"] == 150
    assert_reference(h, prompts, 2)
    h.assert_idle_and_clean()


def test_lof_runs_the_longest_output_first():
    h = SchedulerHarness(max_running_requests=1, schedule_policy="lof")
    news = {"a": 2, "b": 6, "c": 4}
    prompts = {rid: prompt(i, 20) for i, rid in enumerate(news)}
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=news[rid])
    h.run_until_idle()
    assert first_extends(h) == ["b", "c", "a"]
    assert_reference(h, prompts, news)


# ==== chunked prefill ======================================================================
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
@BOTH_LOOPS
def test_chunked_prefill_cuts_at_the_chunk_size_and_finishes_right(radix, overlap):
    h = SchedulerHarness(chunked_prefill_size=16, overlap=overlap, disable_radix_cache=not radix)
    p = prompt(5, 50)
    h.submit("long", p, max_new_tokens=5)
    h.run_until_idle()
    assert [reqs for reqs in h.extend_batches()] == [[("long", 16)], [("long", 16)], [("long", 16)], [("long", 2)]]
    assert h.tokens("long") == expected_tokens(p, 5) and h.finish["long"] == "length"
    h.assert_idle_and_clean()


def test_chunk_budget_is_shared_by_the_requests_of_a_step():
    """Each step computes at most chunked_prefill_size prompt tokens; a cut request goes on first."""
    h = SchedulerHarness(chunked_prefill_size=32)
    prompts = {"a": prompt(1, 40), "b": prompt(2, 20), "c": prompt(3, 10)}
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=3)
    h.step()
    assert h.extend_batches() == [[("a", 32)]]
    assert h.s.chunked_req.rid == "a"
    h.step()
    # a's last 8, then b fits (20), then c is cut to the 4 left.
    assert h.extend_batches()[-1] == [("a", 8), ("b", 20), ("c", 4)]
    h.run_until_idle()
    for reqs in h.extend_batches():
        assert sum(n for _, n in reqs) <= 32
    assert_reference(h, prompts, 3)
    h.assert_idle_and_clean()


# ==== token budgets ==========================================================================
def test_max_prefill_tokens_limits_each_step():
    h = SchedulerHarness(max_prefill_tokens=32)
    prompts = {f"r{i}": prompt(i, 10) for i in range(5)}
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=2)
    h.step()
    assert h.extend_batches() == [[("r0", 10), ("r1", 10), ("r2", 10)]]  # a 4th would make 40 > 32
    h.run_until_idle()
    assert_reference(h, prompts, 2)


def test_a_prompt_over_max_prefill_tokens_runs_alone_without_chunking():
    h = SchedulerHarness(max_prefill_tokens=16)
    prompts = {"small": prompt(1, 8), "big": prompt(2, 40), "after": prompt(3, 8)}
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=2)
    h.run_until_idle()
    assert h.extend_batches()[:3] == [[("small", 8)], [("big", 40)], [("after", 8)]]
    assert_reference(h, prompts, 2)


def test_max_running_requests_caps_the_running_batch():
    h = SchedulerHarness(max_running_requests=2)
    news = {f"r{i}": 3 + i for i in range(5)}
    prompts = {rid: prompt(i, 12) for i, rid in enumerate(news)}
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=news[rid])
    assert h.runner.req_to_token_pool.size == 3  # ModelRunner's rows: the cap + 1
    peak = 0
    while h.s.has_work() or h.io.inbox:
        h.step()
        peak = max(peak, len(h.s.running_reqs()))
        assert len(h.s.running_reqs()) <= 2
    assert peak == 2
    assert first_extends(h) == list(news)
    assert_reference(h, prompts, news)
    h.assert_idle_and_clean()


def test_a_request_that_can_never_fit_is_rejected_with_the_numbers():
    h = SchedulerHarness(max_total_tokens=64)
    h.submit("huge", prompt(1, 60), max_new_tokens=10)
    h.submit("empty", [], max_new_tokens=1)
    h.step()
    assert h.finish == {"huge": "abort", "empty": "abort"}
    assert "can never fit in the KV pool of 64 tokens" in h.errors["huge"]
    assert h.errors["empty"] == "the prompt is empty"
    h.assert_idle_and_clean()


# ==== retraction under KV pressure ===============================================================
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
@BOTH_LOOPS
def test_retraction_under_kv_pressure_keeps_every_token_right(overlap, radix):
    # 6 * (8 + 40) tokens wanted at peak, 120 in the pool: admission reserves only part of a running
    # request's remaining tokens (new_token_ratio), so decoding runs out and retracts.
    h = SchedulerHarness(max_total_tokens=120, overlap=overlap, disable_radix_cache=not radix)
    prompts = {f"r{i}": prompt(i, 8) for i in range(6)}
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=40)
    h.run_until_idle()
    retracted = h.trace(ev.ReqRetracted)
    assert h.s.num_retracted_total == len(retracted) > 0
    # Retracted requests come back, recompute prompt + what they had produced, and finish right.
    assert_reference(h, prompts, 40)
    h.assert_idle_and_clean()


def test_retraction_picks_the_request_that_decoded_least_and_requeues_it_first():
    h = SchedulerHarness(max_total_tokens=140)
    prompts = {f"r{i}": prompt(i, 8 + i % 2) for i in range(6)}
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=40)
    checked = 0
    while h.s.has_work() or h.io.inbox:
        before = {r.rid: (len(r.output_ids), -len(r.origin_input_ids)) for r in h.s.running_reqs()}
        n = len(h.trace(ev.ReqRetracted))
        h.step()
        new = [e.rid for e in h.trace(ev.ReqRetracted)[n:]]
        if new:
            # Fewest output tokens first (cheapest to redo), longest prompt among equals; back at the
            # head of the queue, in that order, marked retracted.
            assert new == sorted(before, key=before.get)[: len(new)]
            assert [r.rid for r in h.s.waiting_queue[: len(new)]] == new
            assert all(r.is_retracted and r.req_pool_idx is None for r in h.s.waiting_queue[: len(new)])
            checked += 1
    assert checked > 0
    assert_reference(h, prompts, 40)
    h.assert_idle_and_clean()


# ==== abort in each state =======================================================================
@BOTH_LOOPS
def test_abort_while_waiting(overlap):
    h = SchedulerHarness(max_running_requests=1, overlap=overlap)
    h.submit("a", prompt(1, 20), max_new_tokens=4)
    h.submit("b", prompt(2, 20), max_new_tokens=4)
    h.step()
    assert [r.rid for r in h.s.waiting_queue] == ["b"]
    h.send(AbortReq(rid="b"))
    h.step()
    assert h.finish["b"] == "abort" and h.errors["b"] == "aborted" and h.tokens("b") == []
    h.run_until_idle()
    assert h.tokens("a") == expected_tokens(prompt(1, 20), 4)
    assert "b" not in first_extends(h)
    h.assert_idle_and_clean()


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
@BOTH_LOOPS
def test_abort_a_chunked_request_mid_prefill(radix, overlap):
    h = SchedulerHarness(chunked_prefill_size=16, overlap=overlap, disable_radix_cache=not radix)
    p = prompt(1, 60)
    h.submit("long", p, max_new_tokens=4)
    h.submit("other", prompt(2, 10), max_new_tokens=2)
    h.step()
    h.step()
    assert h.s.chunked_req is not None and h.s.chunked_req.rid == "long"
    h.send(AbortReq(rid="long"))
    h.run_until_idle()
    assert h.finish["long"] == "abort" and h.tokens("long") == []
    assert [n for reqs in h.extend_batches() for rid, n in reqs if rid == "long"] in ([16, 16], [16, 16, 16])
    assert h.tokens("other") == expected_tokens(prompt(2, 10), 2)
    h.assert_idle_and_clean()
    if radix:  # the computed chunks stay cached (evictable), so a retry reuses them
        h.submit("retry", p, max_new_tokens=2)
        h.run_until_idle()
        assert h.cached["retry"] >= 32 and h.tokens("retry") == expected_tokens(p, 2)


@BOTH_LOOPS
def test_abort_while_decoding_keeps_the_tokens_so_far(overlap):
    h = SchedulerHarness(overlap=overlap)
    p = prompt(1, 20)
    h.submit("a", p, max_new_tokens=50)
    h.submit("b", prompt(2, 20), max_new_tokens=6)
    for _ in range(5):
        h.step()
    assert "a" in [r.rid for r in h.s.running_reqs()]
    h.send(AbortReq(rid="a"))
    h.run_until_idle()
    got = h.tokens("a")
    assert h.finish["a"] == "abort" and 3 <= len(got) < 50
    assert got == expected_tokens(p, len(got))
    assert h.tokens("b") == expected_tokens(prompt(2, 20), 6)
    h.assert_idle_and_clean()


@BOTH_LOOPS
def test_abort_right_after_prefill(overlap):
    """Prefilled but not yet in the running batch (it joins at the next step)."""
    h = SchedulerHarness(overlap=overlap)
    h.submit("a", prompt(1, 20), max_new_tokens=10)
    h.step()
    assert [r.rid for r in h.s.just_prefilled_reqs()] == ["a"]
    h.send(AbortReq(rid="a"))
    h.run_until_idle()
    assert h.finish["a"] == "abort" and len(h.tokens("a")) <= 2
    h.assert_idle_and_clean()


def test_abort_all():
    h = SchedulerHarness(chunked_prefill_size=16, max_running_requests=2)
    for i in range(4):
        h.submit(f"r{i}", prompt(i, 30), max_new_tokens=20)
    for _ in range(4):
        h.step()
    h.send(AbortReq(rid=""))
    h.run_until_idle()
    assert h.finish == {f"r{i}": "abort" for i in range(4)}
    h.assert_idle_and_clean()


# ==== the step gate ==============================================================================
@BOTH_LOOPS
def test_step_gate_runs_exactly_the_steps_asked(overlap):
    h = SchedulerHarness(overlap=overlap)
    h.send(StepGateReq(action="pause"))
    h.submit("a", prompt(1, 20), max_new_tokens=6)
    for _ in range(5):
        h.step()
    assert h.batches == [] and h.replies == [StepGateReqOutput(paused=True, step=0)]
    h.send(StepGateReq(action="step", steps=2))
    for _ in range(4):
        h.step()
    assert [mode for mode, _ in h.batches] == ["extend", "decode"]
    assert h.replies[-1] == StepGateReqOutput(paused=True, step=2)
    assert h.tokens("a") == expected_tokens(prompt(1, 20), 2)  # each gated step ends processed
    h.send(StepGateReq(action="resume"))
    h.run_until_idle()
    assert h.replies[-1] == StepGateReqOutput(paused=False, step=2)
    assert h.tokens("a") == expected_tokens(prompt(1, 20), 6)


def test_a_step_with_nothing_to_run_answers_at_once():
    h = SchedulerHarness()
    h.send(StepGateReq(action="step", steps=3))
    h.step()
    assert h.replies == [StepGateReqOutput(paused=True, step=0)] and h.s.step_credits == 0


# ==== in-batch prefix caching =====================================================================
@BOTH_LOOPS
def test_requests_sharing_an_uncached_prefix_wait_for_the_first(overlap):
    h = SchedulerHarness(overlap=overlap)
    shared = prompt(50, 64)
    prompts = {f"r{i}": prompt(i, 80, shared) for i in range(3)}
    prompts["solo"] = prompt(9, 40)
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=3)
    h.step()
    assert h.extend_batches()[0] == [("r0", 80), ("solo", 40)]  # solo shares nothing: not held
    assert [(x.rid, x.waits_for, x.shared_tokens) for x in h.s.held_back] == [("r1", "r0", 64), ("r2", "r0", 64)]
    h.run_until_idle()
    assert h.extend_batches()[1] == [("r1", 16), ("r2", 16)]
    assert h.cached["r1"] == h.cached["r2"] == 64 and h.cached["r0"] == 0
    assert_reference(h, prompts, 3)
    h.assert_idle_and_clean()


def test_a_short_shared_head_holds_nobody():
    h = SchedulerHarness()
    head = prompt(50, THRESHOLD - 1)
    for i in range(3):
        h.submit(f"r{i}", prompt(i, 60, head), max_new_tokens=2)
    h.step()
    assert [rid for rid, _ in h.extend_batches()[0]] == ["r0", "r1", "r2"] and h.s.held_back == []


def test_held_requests_wait_for_every_chunk_of_the_prefix():
    h = SchedulerHarness(chunked_prefill_size=32)
    shared = prompt(50, 96)
    h.submit("first", prompt(1, 100, shared), max_new_tokens=2)
    h.submit("second", prompt(2, 100, shared), max_new_tokens=2)
    h.run_until_idle()
    # first's 100 tokens in chunks of 32; second waits for all of them, then computes only its own 4.
    assert [reqs for reqs in h.extend_batches()] == [
        [("first", 32)],
        [("first", 32)],
        [("first", 32)],
        [("first", 4), ("second", 4)],
    ]
    assert h.cached["second"] == 96


# ==== radix locks ================================================================================
def test_radix_locks_follow_running_requests_and_are_released():
    h = SchedulerHarness()
    base = prompt(7, 64)
    h.submit("warm", base, max_new_tokens=1)
    h.run_until_idle()
    assert h.s.tree_cache.protected_size() == 0
    h.submit("a", prompt(1, 80, base), max_new_tokens=5)
    h.submit("b", prompt(2, 70, base), max_new_tokens=5)
    h.step()
    h.step()
    # While they decode, their prompts (the shared 64 and their own tails) are locked.
    assert h.s.tree_cache.protected_size() == 64 + 16 + 6
    assert h.s.check_kv_invariants()["locked"] == 64 + 16 + 6
    h.send(AbortReq(rid="b"))
    h.run_until_idle()
    assert h.finish == {"warm": "length", "a": "length", "b": "abort"}
    assert all(n.lock_ref == 0 for n in h.s.tree_cache._iter_nodes())
    h.assert_idle_and_clean()


# ==== overlap == normal, and a random workload ======================================================
def _random_workload(seed: int):
    rng = random.Random(seed)
    shared = [prompt(1000 + k, rng.randrange(20, 80)) for k in range(3)]
    reqs = []
    for i in range(rng.randrange(4, 12)):
        n = rng.randrange(8, 120)
        start = rng.choice(shared + [[]])[: n - 1]
        reqs.append((f"r{i}", prompt(seed * 100 + i, n, start), rng.randrange(1, 24), rng.randrange(0, 4)))
    cfg = dict(
        max_total_tokens=rng.choice([160, 256, 1024]),
        chunked_prefill_size=rng.choice([-1, 16, 48]),
        max_running_requests=rng.choice([2, 4, 16]),
        schedule_policy=rng.choice(["fcfs", "lpm", "dfs-weight"]),
        disable_radix_cache=rng.random() < 0.2,
    )
    return reqs, cfg


def _run(reqs, cfg, overlap: bool) -> SchedulerHarness:
    h = SchedulerHarness(overlap=overlap, **cfg)
    pending = sorted(reqs, key=lambda r: r[3])
    step = 0
    while pending or h.s.has_work():
        while pending and pending[0][3] <= step:
            rid, p, n, _ = pending.pop(0)
            h.submit(rid, p, max_new_tokens=n)
        h.step()
        step += 1
        assert step < 2000
    h.step()
    return h


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_match_the_reference_in_both_loops(seed):
    reqs, cfg = _random_workload(seed)
    runs = [_run(reqs, cfg, overlap) for overlap in (False, True)]
    for h in runs:
        for rid, p, n, _ in reqs:
            assert h.tokens(rid) == expected_tokens(p, n), (rid, cfg)
            assert h.finish[rid] == "length"
        if cfg["chunked_prefill_size"] > 0:
            assert all(sum(n for _, n in reqs_) <= cfg["chunked_prefill_size"] for reqs_ in h.extend_batches())
        h.assert_idle_and_clean()
    assert runs[0].out == runs[1].out and runs[0].finish == runs[1].finish  # overlap == normal


# ==== the KV integrity check itself ====================================================================
def test_kv_check_catches_a_leaked_slot_and_names_the_numbers():
    h = SchedulerHarness(max_total_tokens=128)
    h.submit("a", prompt(1, 20), max_new_tokens=3)
    h.run_until_idle()
    h.s.token_to_kv_pool_allocator.alloc(2)  # two slots nobody owns
    with pytest.raises(KVInvariantError, match=r"free 105 \+ cached 22 .* = 127 != total 128|slots nowhere"):
        h.s.check_kv_invariants()
    with pytest.raises(KVInvariantError, match="2 slots nowhere"):
        h.s.check_kv_invariants()


def test_kv_check_catches_a_double_free_a_lost_lock_and_a_lost_row():
    h = SchedulerHarness(max_total_tokens=128)
    h.submit("a", prompt(1, 20), max_new_tokens=3)
    h.run_until_idle()
    tree = h.s.tree_cache
    node = next(iter(tree.root_node.children.values()))
    h.s.token_to_kv_pool_allocator.free(node.value[:1].clone())  # freed while still cached
    with pytest.raises(KVInvariantError, match="1 slots counted twice .*free, cache"):
        h.s.check_kv_invariants()

    h = SchedulerHarness(max_total_tokens=128)
    h.submit("a", prompt(1, 20), max_new_tokens=3)
    h.run_until_idle()
    node = next(iter(h.s.tree_cache.root_node.children.values()))
    h.s.tree_cache.inc_lock_ref(node)  # a lock nobody will release
    with pytest.raises(KVInvariantError, match=r"lock_ref 1, 0 live requests use it"):
        h.s.check_kv_invariants()

    h = SchedulerHarness(max_total_tokens=128)
    h.s.req_to_token_pool.alloc(1)  # a row nobody holds
    with pytest.raises(KVInvariantError, match=r"request rows in use 1 != 0 live requests"):
        h.s.check_kv_invariants()


def test_idle_check_runs_with_the_flag_and_reports_through_internal_state(monkeypatch):
    from workbench.core.io_struct import GetInternalStateReq

    monkeypatch.delenv(KV_CHECK_ENV, raising=False)
    h = SchedulerHarness(max_total_tokens=128, enable_kv_invariant_check=True, check=False)
    assert h.s.kv_check_enabled
    h.submit("a", prompt(1, 20), max_new_tokens=3)
    h.run_until_idle()
    assert h.s.kv_check_error == ""
    h.s.token_to_kv_pool_allocator.alloc(1)  # leak one slot, then run one more request
    h.submit("b", prompt(2, 20), max_new_tokens=3)
    h.run_until_idle()  # going idle runs the check once
    assert "1 slots nowhere (leaked)" in h.s.kv_check_error
    h.send(GetInternalStateReq())
    h.step()
    state = [r for r in h.replies if isinstance(r, GetInternalStateReqOutput)][-1]
    assert "1 slots nowhere" in state.kv_check_error


def test_env_override_turns_the_check_on_and_off(monkeypatch):
    monkeypatch.setenv(KV_CHECK_ENV, "1")
    assert SchedulerHarness(check=False).s.kv_check_enabled
    monkeypatch.setenv(KV_CHECK_ENV, "0")
    assert not SchedulerHarness(check=False, enable_kv_invariant_check=True).s.kv_check_enabled


def test_schedule_conservativeness_scales_the_expected_decoding():
    """SGLang's rule: admission reserves new_token_ratio of a running request's remaining tokens,
    starting at 0.7 x conservativeness (at most 1) and never decaying below 0.1 x conservativeness."""
    assert SchedulerHarness().s.new_token_ratio == pytest.approx(0.7)
    eager, careful = SchedulerHarness(schedule_conservativeness=0.5), SchedulerHarness(schedule_conservativeness=2.0)
    assert eager.s.new_token_ratio == pytest.approx(0.35) and eager.s.min_new_token_ratio == pytest.approx(0.05)
    assert careful.s.new_token_ratio == 1.0


@BOTH_LOOPS
def test_tokens_go_out_by_sglangs_stream_rule_unless_a_view_listens(overlap):
    """First token at once, the end at once; between them a streaming request sends every
    --stream-interval tokens and a non-streaming one every 50 (SGLang's rule), unless the trace is on
    (a view shows each request's text growing), when every token goes out. The tokens are the same."""
    from workbench.core.managers.scheduler_output import NON_STREAM_INTERVAL

    def run(trace: bool) -> SchedulerHarness:
        h = SchedulerHarness(overlap=overlap, stream_interval=3)
        h.s.tracer.set_enabled(trace)
        h.submit("quiet", prompt(1, 20), max_new_tokens=2 * NON_STREAM_INTERVAL + 19)
        h.submit("stream", prompt(2, 12), max_new_tokens=10, stream=True)
        h.run_until_idle()
        assert h.tokens("quiet") == expected_tokens(prompt(1, 20), 2 * NON_STREAM_INTERVAL + 19)
        assert h.tokens("stream") == expected_tokens(prompt(2, 12), 10)
        assert h.finish == {"quiet": "length", "stream": "length"}
        return h

    quiet = run(trace=False)
    assert quiet.sends["quiet"] == [1, NON_STREAM_INTERVAL, NON_STREAM_INTERVAL, 18]
    assert quiet.sends["stream"] == [1, 3, 3, 3]
    watched = run(trace=True)
    assert watched.sends["quiet"] == [1] * (2 * NON_STREAM_INTERVAL + 19)
    assert watched.sends["stream"] == [1, 3, 3, 3]


# ==== the step clock seam (scheduler_contract.StepClock) ====================================================
@BOTH_LOOPS
def test_a_step_clock_handed_in_takes_every_receive_and_sees_every_step(overlap):
    """The Scheduler's top of loop, end of step and internal state go through the StepClock it is handed
    (the live simulator keeps its simulated time there): every receive is the clock's, `after_step`
    sees each step's batch (None when nothing ran), and `fill_state` adds to get_internal_state."""
    from workbench.core.managers.scheduler_contract import HostStepClock

    class Recording(HostStepClock):
        def __init__(self):
            self.received, self.after = 0, []

        def recv(self, scheduler):
            msgs = super().recv(scheduler)
            self.received += len(msgs)
            return msgs

        def after_step(self, scheduler, batch):
            self.after.append(None if batch is None else [r.rid for r in batch.reqs])

        def fill_state(self, state):
            state.received_total = self.received

    clock = Recording()
    h = SchedulerHarness(overlap=overlap, step_clock=clock)
    h.submit("a", prompt(1, 12), max_new_tokens=3)
    h.submit("b", prompt(2, 9), max_new_tokens=2)
    h.run_until_idle()
    assert h.tokens("a") == expected_tokens(prompt(1, 12), 3) and h.tokens("b") == expected_tokens(prompt(2, 9), 2)
    ran = [reqs for reqs in clock.after if reqs is not None]
    assert ran == [[rid for rid, _ in reqs] for _, reqs in h.batches]  # one after_step per step, its batch
    assert clock.after[-1] is None  # the idle iteration ran nothing
    h.send(GetInternalStateReq())
    h.step()
    (state,) = [r for r in h.replies if isinstance(r, GetInternalStateReqOutput)]
    assert state.received_total == 3  # two requests and the state request, as the clock counted them
