"""Speculative decoding (NGRAM) in the real scheduler, in-process: a stand-in model whose output
repeats (so drafts are often right) and really reads the KV slots the scheduler hands out. Every
step the harness checks the KV invariants; each test ends with every slot free or cached.

Token for token against the stand-in's plain greedy output: a batch, chunked prefill with the radix
cache, a retraction under KV pressure, an abort mid-decode (the last three in the normal and the
overlap loop), max_new_tokens and a stop token landing inside a run of accepted drafts."""

from __future__ import annotations

import pytest
from scheduler_harness import SchedulerHarness, expected_tokens, repetitive_token
from workbench.core.io_struct import AbortReq
from workbench.core.trace import events as ev


def prompt(i: int, n: int) -> list[int]:
    return [(i * 37 + j * 11) % 900 + 10 for j in range(n)]


def spec_harness(**kw) -> SchedulerHarness:
    kw.setdefault("speculative_algorithm", "NGRAM")
    return SchedulerHarness(rule=repetitive_token, **kw)


def expected(p: list[int], n: int) -> list[int]:
    return expected_tokens(p, n, rule=repetitive_token)


def verdicts(h: SchedulerHarness) -> list[ev.SpecReq]:
    return [r for e in h.trace(ev.SpecVerify) for r in e.reqs]


def test_a_batch_decodes_the_same_tokens_in_fewer_steps():
    prompts = {f"r{i}": prompt(i, 6 + i) for i in range(6)}
    plain = SchedulerHarness(rule=repetitive_token)
    spec = spec_harness(speculative_num_draft_tokens=4)
    for h in (plain, spec):
        for rid, p in prompts.items():
            h.submit(rid, p, max_new_tokens=40)
        h.run_until_idle()
        for rid, p in prompts.items():
            assert h.tokens(rid) == expected(p, 40), rid
        h.assert_idle_and_clean()
    v = verdicts(spec)
    assert sum(r.accepted for r in v) > 40 and all(0 <= r.accepted <= len(r.drafts) <= 4 for r in v)
    decode_steps = lambda h: sum(1 for mode, _ in h.batches if mode == "decode")  # noqa: E731
    assert decode_steps(spec) < decode_steps(plain) * 0.7  # accepted drafts save steps
    # the batch.step of a verify step counts each request's drafts
    steps = [e for e in spec.trace(ev.BatchStep) if any(s.drafts for s in e.reqs)]
    assert steps and all(s.decode == 1 for e in steps for s in e.reqs)


def test_max_new_tokens_is_exact_and_drafts_never_pass_it():
    h = spec_harness(speculative_num_draft_tokens=8)
    for i, n in enumerate((1, 2, 3, 5, 9, 17)):
        h.submit(f"n{n}", prompt(i, 8), max_new_tokens=n)
    h.run_until_idle()
    for i, n in enumerate((1, 2, 3, 5, 9, 17)):
        assert h.tokens(f"n{n}") == expected(prompt(i, 8), n)
    h.assert_idle_and_clean()


def test_a_stop_token_inside_accepted_drafts_ends_the_output_there():
    # A prompt that already holds the output's cycle, so drafts stand from the first step; the stop
    # token is the first output token (from the third on) not seen earlier in the output.
    for i in range(40):
        base = prompt(i, 8)
        p = base + expected(base, 24)
        ref = expected(p, 60)
        fresh = [k for k in range(2, 20) if ref[k] not in ref[:k]]
        if fresh:
            break
    first = fresh[0]
    stop = ref[first]
    h = spec_harness(speculative_num_draft_tokens=8)
    h.submit("s", p, max_new_tokens=60, stop_token_ids=[stop])
    h.run_until_idle()
    assert h.tokens("s") == ref[: first + 1] and h.finish["s"] == "stop"
    last = [r for r in verdicts(h) if r.rid == "s"][-1]
    # the step that met the stop token had drafts standing past it: the output was cut inside them
    assert stop in last.drafts[: last.accepted] or last.accepted == len(last.drafts)
    h.assert_idle_and_clean()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal-loop", "overlap-loop"])
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
def test_chunked_prefill_then_speculation(radix, overlap):
    h = spec_harness(chunked_prefill_size=16, disable_radix_cache=not radix, overlap=overlap)
    prompts = {"long": prompt(1, 70), "short": prompt(2, 9)}
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=30)
    h.run_until_idle()
    for rid, p in prompts.items():
        assert h.tokens(rid) == expected(p, 30)
    assert verdicts(h)
    h.assert_idle_and_clean()
    if radix:  # what a finished request decoded, drafts included, is cached like any output
        h.submit("again", prompts["long"] + expected(prompts["long"], 20), max_new_tokens=5)
        h.run_until_idle()
        assert h.cached["again"] >= 70 + 19 and h.tokens("again") == expected(prompts["long"], 25)[20:]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal-loop", "overlap-loop"])
def test_retraction_under_kv_pressure(overlap):
    h = spec_harness(max_total_tokens=160, overlap=overlap)
    prompts = {f"r{i}": prompt(i, 8) for i in range(6)}
    for rid, p in prompts.items():
        h.submit(rid, p, max_new_tokens=40)
    h.run_until_idle()
    assert h.s.num_retracted_total > 0 and verdicts(h)
    for rid, p in prompts.items():
        assert h.tokens(rid) == expected(p, 40), rid
    h.assert_idle_and_clean()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal-loop", "overlap-loop"])
def test_abort_while_verifying_keeps_the_tokens_so_far(overlap):
    h = spec_harness(overlap=overlap)
    p = prompt(1, 12)
    h.submit("a", p, max_new_tokens=200)
    h.submit("b", prompt(2, 12), max_new_tokens=30)
    for _ in range(6):
        h.step()
    h.send(AbortReq(rid="a"))
    h.run_until_idle()
    got = h.tokens("a")
    assert h.finish["a"] == "abort" and 5 <= len(got) < 200 and got == expected(p, len(got))
    assert h.tokens("b") == expected(prompt(2, 12), 30)
    h.assert_idle_and_clean()


def test_drafts_that_keep_failing_back_off():
    """Text that does not repeat itself: after each verify step that kept nothing the request drafts
    nothing for 1, 2, 4, ... steps, so it mostly decodes plainly (and its tokens stay right)."""
    from scheduler_harness import next_token

    p = list(range(10, 400))  # every output token in 10..399 matches the prompt once: a draft, always wrong
    h = SchedulerHarness(rule=next_token, speculative_algorithm="NGRAM")
    h.submit("a", p, max_new_tokens=80)
    h.run_until_idle()
    assert h.tokens("a") == expected_tokens(p, 80)
    mine = [r for r in verdicts(h) if r.rid == "a" and r.drafts]
    would = sum(1 for t in expected_tokens(p, 79) if 10 <= t < 399)  # steps that had a draft to offer
    assert mine and all(r.accepted == 0 for r in mine)
    assert would >= 15 and len(mine) <= 7, (would, len(mine))  # 1 + 1 + 2 + 4 + 8 + 16 + 32 steps cover 80
    h.assert_idle_and_clean()
