"""A narrated step (#15 item 1): each scheduler step says what it decided and why.

- The scheduler (in-process, stand-in worker) fills `batch.decision` right: admitted rids, why
  the rest wait (token budget, KV room, running limit, held back), the token budget and its use,
  chunk k of n across a chunked prompt, KV slots allocated = tokens computed, retractions.
- TraceState turns a step (batch.step + its batch.decision, in either order; or an old recording's
  batch.step alone) into one sentence.
"""

from __future__ import annotations

import pytest
from scheduler_harness import SchedulerHarness
from synthetic import synthetic_trace
from workbench.core.trace import events as ev
from workbench.core.trace.state import TraceState


def _by_step(h: SchedulerHarness, kind) -> dict[int, object]:
    return {e.step: e for e in h.trace(kind)}


def _prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize("overlap", [False, True])
def test_decision_names_admitted_budget_waiting_and_kv(overlap):
    h = SchedulerHarness(chunked_prefill_size=64, overlap=overlap)
    h.submit("a", _prompt(10, 40), 3)
    h.submit("b", _prompt(100, 50), 3)  # 24 fit after a's 40: cut, chunk 1 of 2
    h.submit("c", _prompt(200, 30), 3)  # the budget is spent: waits
    h.run_until_idle()
    dec, steps = _by_step(h, ev.StepDecision), _by_step(h, ev.BatchStep)
    assert set(dec) == set(steps)  # one decision per step that ran a batch
    d1 = dec[1]
    assert (d1.mode, d1.admitted, d1.chunk_continued) == ("extend", ["a", "b"], "")
    assert (d1.budget, d1.budget_used) == (64, 64)
    assert (d1.waiting, d1.stop_reason, d1.stop_rid) == (1, "budget", "c")
    assert d1.kv_alloc == sum(r.computed for r in steps[1].reqs) == 64
    d2 = dec[2]
    assert (d2.admitted, d2.chunk_continued, d2.budget_used) == (["c"], "b", 26 + 30)
    assert (d2.waiting, d2.stop_reason, d2.running_waited) == (0, "", 1)  # a did not advance
    # chunk k of n: b is cut by the shared budget, so 1/2 then 2/2 (not 1/1 then 2/2)
    chunks = [(e.chunk_index, e.num_chunks) for e in h.trace(ev.ReqScheduled) if e.rid == "b"]
    assert chunks == [(0, 2), (1, 2)]
    later = [e for e in h.trace(ev.ReqScheduled) if e.rid == "b" and e.chunk_index > 0]
    assert all(e.prefix_hit == 0 for e in later)  # its own chunk 1 is not a cache hit
    for step, d in dec.items():  # every slot allocated is a token computed or decoded
        s = steps[step]
        # (overlap: a decode row of a request that finished meanwhile still got its slot)
        want = s.batch_size if s.mode == "decode" else sum(r.computed for r in s.reqs)
        assert d.kv_alloc == want, (step, d)
        if s.mode == "decode":
            assert d.budget == 0 and d.admitted == [] and d.running_waited == 0


def test_a_long_prompt_counts_its_chunks_k_of_n():
    h = SchedulerHarness(chunked_prefill_size=32)
    h.submit("long", _prompt(10, 100), 2)  # 32 + 32 + 32 + 4
    h.run_until_idle()
    chunks = [(e.chunk_index, e.num_chunks) for e in h.trace(ev.ReqScheduled)]
    assert chunks == [(0, 4), (1, 4), (2, 4), (3, 4)]
    dec = h.trace(ev.StepDecision)
    assert [d.chunk_continued for d in dec[:4]] == ["", "long", "long", "long"]
    assert [d.admitted for d in dec[:4]] == [["long"], [], [], []]
    assert [d.budget_used for d in dec[:4]] == [32, 32, 32, 4]
    st = TraceState()
    st.apply_many(h.events)
    lines = [st.narrate(s) for s in list(st.steps)[:4]]
    assert "long chunk 1/4" in lines[0] and "long chunk 4/4" in lines[3]
    details = [t.detail for t in st.requests["long"].timeline if t.kind == "prefill"]
    assert details == [
        "chunk 1/4: 0 cached + 32 computed",
        "chunk 2/4: 32 computed",
        "chunk 3/4: 32 computed",
        "chunk 4/4: 4 computed",
    ]


def test_kv_room_and_running_limit_are_named():
    # A small pool: the third request finds no KV room while the first two run.
    h = SchedulerHarness(max_total_tokens=160, chunked_prefill_size=256)
    for i in range(3):
        h.submit(f"r{i}", _prompt(10 + 100 * i, 40), 30)
    h.step()
    d = h.trace(ev.StepDecision)[-1]
    assert d.admitted == ["r0", "r1"] and (d.stop_reason, d.stop_rid, d.waiting) == ("kv", "r2", 1)
    # The running-request limit.
    h = SchedulerHarness(max_running_requests=2, chunked_prefill_size=256)
    for i in range(3):
        h.submit(f"q{i}", _prompt(10 + 100 * i, 20), 5)
    h.step()
    d = h.trace(ev.StepDecision)[-1]
    assert d.admitted == ["q0", "q1"] and (d.stop_reason, d.stop_rid) == ("running", "q2")
    h.step()
    d = h.trace(ev.StepDecision)[-1]
    assert d.mode == "decode" and (d.stop_reason, d.stop_rid, d.waiting) == ("running", "q2", 1)
    st = TraceState()
    st.apply_many(h.events)
    assert st.last_step_line.endswith("1 waiting: running limit (q2 next)")
    assert st.wait_reason("q2") == "running" and st.wait_reason("q0") is None


def test_held_back_requests_are_told_apart():
    shared = _prompt(500, 80)
    h = SchedulerHarness(chunked_prefill_size=256)
    h.submit("first", shared + [1000, 1001], 3)
    h.submit("second", shared + [2000, 2001], 3)  # shares 80 uncached tokens: waits one step
    h.step()
    d = h.trace(ev.StepDecision)[-1]
    assert d.admitted == ["first"] and d.held == ["second"] and d.stop_rid == ""
    st = TraceState()
    st.apply_many(h.events)
    assert "1 waiting: held for a shared prefix" in st.last_step_line
    assert st.wait_reason("second") == "held" and st.wait_reason("first") is None


@pytest.mark.parametrize("radix", [True, False])
def test_retraction_and_eviction_are_in_the_decision(radix):
    h = SchedulerHarness(max_total_tokens=300, chunked_prefill_size=64, disable_radix_cache=not radix)
    for i in range(8):
        h.submit(f"r{i}", _prompt(10 + 50 * i, 40), 40)
    h.run_until_idle()
    dec = h.trace(ev.StepDecision)
    retracted = [rid for d in dec for rid in d.retracted]
    assert retracted and retracted == [e.rid for e in h.trace(ev.ReqRetracted)]
    evicts = h.trace(ev.CacheEvict)
    assert sum(d.evicted for d in dec) == sum(e.tokens for e in evicts)
    assert [n for d in dec for n in d.evicted_nodes] == [n for e in evicts for n in e.node_ids]
    # Every slot handed out and taken back is counted in exactly one step.
    alloc = h.runner.token_to_kv_pool_allocator
    assert sum(d.kv_alloc for d in dec) == alloc.num_allocated
    assert sum(d.kv_freed for d in dec) == alloc.num_freed
    st = TraceState()
    st.apply_many(h.events)
    assert any("retracted 1 (" in st.narrate(s) for s in st.steps)


# ---- the sentence, from synthetic events ---------------------------------------------------------


def _step(step, mode, reqs, ts=1_000):
    return ev.BatchStep(
        ts=ts + step, proc="scheduler", step=step, mode=mode, reqs=reqs, batch_size=len(reqs), padded_size=len(reqs)
    )


def _extend_events():
    reqs = [ev.StepReq(f"sp-{i}", cached=86, computed=1) for i in range(68, 79)]
    step = _step(62, "extend", reqs)
    dec = ev.StepDecision(
        ts=2_000,
        proc="scheduler",
        step=62,
        mode="extend",
        admitted=[f"sp-{i}" for i in range(68, 79)],
        waiting=7,
        stop_reason="budget",
        stop_rid="sp-79",
        held=["sp-85", "sp-86"],
        budget=64,
        budget_used=11,
        running_waited=54,
        kv_alloc=11,
        kv_freed=0,
        evicted=0,
    )
    return step, dec


@pytest.mark.parametrize("decision_first", [False, True])
def test_sentence_of_an_extend_step(decision_first):
    step, dec = _extend_events()
    st = TraceState()
    st.apply_many([dec, step] if decision_first else [step, dec])  # overlap loop: decision first
    line = st.last_step_line
    assert line.startswith("step 62 extend: admitted 11 from waiting (sp-68…sp-78)")
    for part in (
        "946 cached + 11 computed",
        "budget 11/64",
        "54 running waited",
        "KV +11",
        "evicted 0",
        "7 waiting: 2 held for a shared prefix, 5 token budget (sp-79 next)",
    ):
        assert part in line, (part, line)
    assert st.step_rids() == {f"sp-{i}" for i in range(68, 79)}


def test_sentence_of_a_decode_step_with_eviction_and_retraction():
    st = TraceState()
    st.apply(_step(7, "decode", [ev.StepReq(f"r{i}", decode=1) for i in range(3)]))
    st.apply(
        ev.StepDecision(
            ts=5,
            proc="scheduler",
            step=7,
            mode="decode",
            waiting=2,
            stop_reason="kv",
            stop_rid="r3",
            kv_alloc=3,
            kv_freed=45,
            evicted=40,
            evicted_nodes=[4, 9],
            retracted=["r4"],
        )
    )
    assert st.last_step_line == (
        "step 7 decode: 3 running decoded 1 token each · KV +3 −45 · "
        "evicted 40 (2 nodes) · retracted 1 (r4) · 2 waiting: no KV room (r3 next)"
    )
    assert st.step_rids() == {"r4"}


def test_old_recordings_without_decisions_still_read():
    # A recording made before batch.decision existed: the step is told from batch.step alone.
    events = synthetic_trace(n_requests=4, chunk_size=32)
    assert not any(isinstance(e, ev.StepDecision) for e in events)
    st = TraceState()
    for e in events:
        st.apply(ev.decode_json(ev.encode_json(e)))
    lines = [st.narrate(s) for s in st.steps]
    assert all(line.startswith(f"step {s.step} {s.mode}: ") for line, s in zip(lines, st.steps))
    assert any("admitted 1 from waiting (r0)" in x and "computed" in x for x in lines)
    assert not any("KV +" in x for x in lines)  # nothing claimed that was not traced
    # the new event decodes with every field defaulted, too
    d = ev.decode_json(b'{"kind":"batch.decision","step":3}')
    assert isinstance(d, ev.StepDecision) and d.admitted == [] and d.kv_alloc == 0


def test_dashboard_header_tells_the_last_step():
    pytest.importorskip("ipywidgets")
    from workbench.widgets.dashboard import Dashboard

    step, dec = _extend_events()
    dash = Dashboard([step, dec], views=["batch"])
    try:
        dash.refresh()
        assert "last step" in dash.header.value
        assert "admitted 11 from waiting (sp-68…sp-78)" in dash.header.value
        assert "budget 11/64" in dash.header.value and "KV +11" in dash.header.value
    finally:
        dash.close()


def test_a_batch_row_names_four_prefills_then_how_many_more():
    from workbench.tui.panels.batch import composition

    step, dec = _extend_events()
    st = TraceState()
    st.apply_many([step, dec])
    text = composition(st.steps[-1]).plain
    assert text.startswith("sp-68 ") and "sp-71" in text and "sp-72" not in text and text.endswith("+7 more")
    text = composition(st.steps[-1], selected="sp-78").plain  # the selected request is always named
    assert "sp-78" in text and text.endswith("+6 more")
