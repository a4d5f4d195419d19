"""Views a lecture can stand on, accounting and wording (#40 items 1-7): the step line accounts for
every KV slot, the wait reasons say what is true, a request's counts and times have one definition
each, Events are in time order from the first event, and `?` explains the step line's notation."""

from __future__ import annotations

import pytest
from scheduler_harness import SchedulerHarness
from workbench.core.trace import events as ev
from workbench.core.trace.narration import kv_parts
from workbench.core.trace.state import TraceState


def _prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _kv_pressure(overlap: bool, radix: bool) -> SchedulerHarness:
    # 8 x (40 + 40) tokens wanted, 300 in the pool: admission stops at KV room, decoding retracts,
    # finished answers fill the cache and are evicted for the next prompts.
    h = SchedulerHarness(max_total_tokens=300, chunked_prefill_size=64, overlap=overlap, disable_radix_cache=not radix)
    for i in range(8):
        h.submit(f"r{i}", _prompt(10 + 50 * i, 40), 40)
    h.run_until_idle()
    return h


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_step_line_accounts_for_every_held_slot(overlap, radix):
    """Item 1: the parts of `KV +a −b` sum to the change of the held slots (kv.usage's used)
    between steps, and every finish is named with the slots it gave back."""
    h = _kv_pressure(overlap, radix)
    used = {e.step: e.used for e in h.trace(ev.KVUsage)}
    held = 0
    dec = h.trace(ev.StepDecision)
    assert any(d.retracted for d in dec) and (not radix or any(d.evicted for d in dec))
    for d in dec:
        assert d.kv_other == 0, d  # no path moved held slots unaccounted
        assert d.kv_held == used[d.step], d  # the header's figure, after this step
        assert held + sum(v for _, v in kv_parts(d)) == d.kv_held, d
        held = d.kv_held
    finished = {r.rid for d in dec for r in d.released if r.why == "finished" and r.slots > 0}
    assert finished == {f"r{i}" for i in range(8)}
    retracted = [r.rid for d in dec for r in d.released if r.why == "retracted"]
    assert retracted == [e.rid for e in h.trace(ev.ReqRetracted)]
    st = TraceState()
    st.apply_many(h.events)
    lines = [st.narrate(s) for s in st.steps]
    assert any("finished r" in x and "slots)" in x for x in lines)
    assert any("retracted 1 (r" in x and "slots)" in x for x in lines)
    assert all("→ " in x and " held" in x for x in lines)


def test_old_decisions_keep_the_allocator_counts():
    d = ev.decode_json(b'{"kind":"batch.decision","step":3,"kv_alloc":5,"kv_freed":2}')
    assert isinstance(d, ev.StepDecision) and d.kv_held == -1 and kv_parts(d) == []
    from workbench.core.trace.narration import narrate_kv

    assert narrate_kv(d) == ["KV +5 −2"]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_running_limit_is_named_only_when_the_running_requests_fill_it(overlap):
    """Item 2: the step after a request finishes still counts it (SGLang's lag): the reason says so."""
    h = SchedulerHarness(max_running_requests=2, chunked_prefill_size=256, overlap=overlap)
    h.submit("q0", _prompt(10, 20), 2)
    h.submit("q1", _prompt(100, 20), 8)
    h.submit("q2", _prompt(200, 20), 3)
    h.run_until_idle()
    dec = h.trace(ev.StepDecision)
    reasons = [d.stop_reason for d in dec if d.stop_rid == "q2"]
    assert "running" in reasons and "finishing" in reasons, reasons
    # "running" only while q0 and q1 both run: before the step that released q0's slots
    q0_done = next(d.step for d in dec if any(r.rid == "q0" and r.why == "finished" for r in d.released))
    assert all(d.step <= q0_done for d in dec if d.stop_reason == "running")
    st = TraceState()
    st.apply_many(h.events)
    assert any(
        "running limit counting finished requests not filtered out yet (q2 next)" in st.narrate(s) for s in st.steps
    )
