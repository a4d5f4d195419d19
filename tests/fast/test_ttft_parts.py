"""TTFT explained (#15 item 3): TraceState.ttft_parts splits a request's time to first token into
arrived → queued, queued, prefill chunks and first token, from traced timestamps; the parts sum
to the TTFT exactly.

- hand-made events for the two cases seen: a request that arrived while the scheduler was inside
  a long step, and one that waited behind a chunked prefill (token budget);
- the synthetic run and the recorded real-engine fixture (tests/data/tui_trace.jsonl, an older
  recording without batch.decision): every finished request's parts sum to its TTFT;
- the in-process scheduler stamps each batch.decision with when its step began;
- the request detail panel and the Gantt show the parts;
- (e2e) a real engine on the default model: every finished request's parts sum to its TTFT.

The end-to-end tests of this module are in tests/e2e/test_ttft_parts_e2e.py.
"""

from __future__ import annotations

import pytest
from scheduler_harness import SchedulerHarness
from synthetic import check_ttft_sums, synthetic_trace
from tui_helpers import FIXTURE
from workbench.core.trace import events as ev
from workbench.core.trace.recorder import load_trace
from workbench.core.trace.state import TraceState
from workbench.core.trace.ttft import StepIndex, step_start

T = 10**12
MS = 10**6


def _step(step, start, end, reqs, decision_end=None, **d):
    """A step's batch.step (stamped at `end`) and batch.decision (at `decision_end`, began at `start`)."""
    mode = d.pop("mode", "extend")
    return [
        ev.BatchStep(
            ts=end,
            proc="scheduler",
            step=step,
            mode=mode,
            reqs=reqs,
            batch_size=len(reqs),
            padded_size=len(reqs),
            schedule_ms=1.0,
            forward_ms=(end - start) / MS - 1.0,
        ),
        ev.StepDecision(ts=decision_end or end + MS, proc="scheduler", step=step, mode=mode, start_ts=start, **d),
    ]


def _seen_cases() -> list[ev.Event]:
    """long-1 (192 tokens, three chunks of 64) runs alone; `a` arrives
    10 ms into its 6.6 s first step and waits behind its next two chunks; `c` joins `a`'s step."""
    out: list[ev.Event] = [
        ev.ReqArrived(ts=T - 5 * MS, proc="tokenizer", rid="long-1"),
        ev.ReqQueued(ts=T - 4 * MS, proc="scheduler", rid="long-1", prompt_tokens=192, queue_len=1),
        # the scheduler's estimate n changes (2, then 3): the timeline ends up saying 3 for all
        ev.ReqScheduled(
            ts=T + MS, proc="scheduler", step=1, rid="long-1", prefix_hit=0, extend_len=64, chunk_index=0, num_chunks=2
        ),
        ev.ReqArrived(ts=T + 10 * MS, proc="tokenizer", rid="a"),
    ]
    out += _step(
        1,
        T,
        T + 6600 * MS,
        [ev.StepReq("long-1", 0, 64, 0, 0, 2)],
        T + 6650 * MS,
        admitted=["long-1"],
        budget=64,
        budget_used=64,
    )
    out += [
        ev.ReqQueued(ts=T + 6660 * MS, proc="scheduler", step=2, rid="a", prompt_tokens=56, queue_len=1),
        ev.ReqArrived(ts=T + 6665 * MS, proc="tokenizer", rid="c"),
        ev.ReqQueued(ts=T + 6668 * MS, proc="scheduler", step=2, rid="c", prompt_tokens=20, queue_len=2),
        ev.ReqScheduled(
            ts=T + 6671 * MS,
            proc="scheduler",
            step=2,
            rid="long-1",
            prefix_hit=0,
            extend_len=64,
            chunk_index=1,
            num_chunks=3,
        ),
    ]
    out += _step(
        2,
        T + 6670 * MS,
        T + 7670 * MS,
        [ev.StepReq("long-1", 0, 64, 0, 1, 3)],
        chunk_continued="long-1",
        waiting=2,
        stop_reason="budget",
        stop_rid="a",
        budget=64,
        budget_used=64,
    )
    out += [
        ev.ReqScheduled(
            ts=T + 7691 * MS,
            proc="scheduler",
            step=3,
            rid="long-1",
            prefix_hit=0,
            extend_len=64,
            chunk_index=2,
            num_chunks=3,
        )
    ]
    out += _step(
        3,
        T + 7690 * MS,
        T + 8690 * MS,
        [ev.StepReq("long-1", 0, 64, 0, 2, 3)],
        chunk_continued="long-1",
        waiting=2,
        stop_reason="budget",
        stop_rid="a",
        budget=64,
        budget_used=64,
    )
    out += [
        ev.ReqFirstToken(ts=T + 8695 * MS, proc="tokenizer", rid="long-1"),
        ev.ReqScheduled(ts=T + 8701 * MS, proc="scheduler", step=4, rid="a", prefix_hit=16, extend_len=40),
        ev.ReqScheduled(ts=T + 8701 * MS, proc="scheduler", step=4, rid="c", prefix_hit=0, extend_len=20),
    ]
    out += _step(
        4,
        T + 8700 * MS,
        T + 8900 * MS,
        [ev.StepReq("a", 16, 40), ev.StepReq("c", 0, 20)],
        admitted=["a", "c"],
        budget=64,
        budget_used=60,
    )
    out += [
        ev.ReqFirstToken(ts=T + 8950 * MS, proc="tokenizer", rid="a"),
        ev.ReqFirstToken(ts=T + 8951 * MS, proc="tokenizer", rid="c"),
    ]
    out += _step(
        5,
        T + 8910 * MS,
        T + 8990 * MS,
        [ev.StepReq("long-1", decode=1), ev.StepReq("a", decode=1), ev.StepReq("c", decode=1)],
        mode="decode",
    )
    for rid, arrived, first in (
        ("long-1", T - 5 * MS, T + 8695 * MS),
        ("a", T + 10 * MS, T + 8950 * MS),
        ("c", T + 6665 * MS, T + 8951 * MS),
    ):
        ttft = (first - arrived) / 1e9
        out.append(
            ev.ReqFinished(
                ts=T + 9000 * MS,
                proc="tokenizer",
                rid=rid,
                reason="length",
                prompt_tokens=1,
                completion_tokens=2,
                cached_tokens=0,
                ttft=ttft,
                tpot=0.01,
                e2e=ttft + 0.01,
            )
        )
    return out


def test_a_long_step_and_a_chunked_prefill_explain_the_ttft():
    st = TraceState()
    st.apply_many(_seen_cases())
    b = check_ttft_sums(st, "a")
    arrived, queued, prefill, first = b.parts
    # arrived during step 1 (6.65 s from its start to its decision), queued when it ended
    assert (arrived.kind, arrived.start_ts, arrived.end_ts) == ("arrived", T + 10 * MS, T + 6660 * MS)
    assert arrived.steps == (1,) and "inside step 1 (extend, 6.65 s, 1 request)" in arrived.detail
    # passed over by steps 2 and 3 (token budget), which went to long-1's chunks; admitted by step 4
    assert (queued.start_ts, queued.end_ts, queued.steps) == (T + 6660 * MS, T + 8700 * MS, (2, 3))
    assert "passed over by 2 steps: token budget ×2" in queued.detail
    assert "long-1 (chunked ×2)" in queued.detail and queued.others == ("long-1",)
    assert (prefill.label, prefill.start_ts, prefill.end_ts) == ("prefill", T + 8700 * MS, T + 8900 * MS)
    assert prefill.others == ("c",) and "16 cached + 40 computed, with c (60 tokens computed in all)" in prefill.detail
    assert (first.start_ts, first.end_ts) == (T + 8900 * MS, T + 8950 * MS) and "step 4" in first.detail
    assert b.summary().startswith("TTFT 8.94 s = 6.65 s arrived → queued + 2.04 s queued + 200 ms prefill")
    # c arrived while the scheduler was between steps 1 and 2... then waited behind a like a did
    c = check_ttft_sums(st, "c")
    assert c.parts[1].steps == (2, 3) and "queued behind a" in c.parts[1].detail


def test_chunks_are_counted_k_of_n_after_the_fact():
    st = TraceState()
    st.apply_many(_seen_cases())
    b = check_ttft_sums(st, "long-1")
    chunks = [p for p in b.parts if p.kind == "prefill"]
    assert [p.label for p in chunks] == ["chunk 1/3", "chunk 2/3", "chunk 3/3"]
    assert [p.steps for p in chunks] == [(1,), (2,), (3,)]
    assert "0 cached + 64 computed, alone" in chunks[0].detail
    assert "cached" not in chunks[1].detail  # its own chunk 1 is not a cache hit
    assert "prefill (3 chunks)" in b.summary()
    # the timeline's labels follow the last estimate too: never 1/2 then 2/3
    assert [t.detail for t in st.requests["long-1"].timeline if t.kind == "prefill"] == [
        "chunk 1/3: 0 cached + 64 computed",
        "chunk 2/3: 64 computed",
        "chunk 3/3: 64 computed",
    ]


def test_parts_so_far_while_waiting():
    events = _seen_cases()
    cut = next(i for i, e in enumerate(events) if isinstance(e, ev.StepDecision) and e.step == 2) + 1
    st = TraceState()
    st.apply_many(events[:cut])
    b = st.ttft_parts("a")
    assert b.partial and b.end_ts == st.last_ts and [p.kind for p in b.parts] == ["arrived", "queued"]
    assert sum(p.ns for p in b.parts) == st.last_ts - st.requests["a"].arrival_ts
    assert "token budget ×1" in b.parts[1].detail and b.summary().startswith("so far")
    assert st.ttft_parts("nobody") is None


@pytest.mark.parametrize("reorder", [False, True])
def test_every_synthetic_request_sums_exactly(reorder):
    st = TraceState()
    st.apply_many(synthetic_trace(n_requests=12, chunk_size=16, max_running=3, reorder=reorder))
    idx = StepIndex(st)
    done = [r for r in st.requests.values() if r.state == "finished"]
    assert len(done) == 12
    for r in done:
        b = check_ttft_sums(st, r.rid)
        assert b == st.ttft_parts(r.rid, idx)  # a shared index gives the same answer
        pre = [t for t in r.timeline if t.kind == "prefill"]
        chunks = [p for p in b.parts if p.kind == "prefill"]
        assert len(chunks) == len(pre)
        assert chunks[0].start_ts == step_start(next(s for s in st.steps if s.step == pre[0].step))
    assert any(len([p for p in st.ttft_parts(r.rid).parts if p.kind == "prefill"]) > 1 for r in done)


def test_the_recorded_engine_trace_sums_exactly():
    """tests/data/tui_trace.jsonl was recorded from a real engine (before batch.decision existed)."""
    st = TraceState()
    st.apply_many(load_trace(FIXTURE))
    done = [r for r in st.requests.values() if r.state == "finished"]
    assert len(done) == 7
    for r in done:
        check_ttft_sums(st, r.rid)
    chunks = [p for p in st.ttft_parts("long-1").parts if p.kind == "prefill"]
    n = len(chunks)
    assert n > 1 and [p.label for p in chunks] == [f"chunk {k}/{n}" for k in range(1, n + 1)]
    # recorded before the scheduler counted k of n right (it said 1/1, then 2/2): the timeline
    # relabels the earlier chunks as later ones come
    labels = [t.detail.split(":")[0] for t in st.requests["long-1"].timeline if t.kind == "prefill"]
    assert labels == [f"chunk {k}/{n}" for k in range(1, n + 1)]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_scheduler_stamps_when_each_step_began(overlap):
    h = SchedulerHarness(chunked_prefill_size=32, overlap=overlap)
    h.submit("long", list(range(10, 110)), 3)
    h.submit("b", list(range(200, 230)), 3)
    h.run_until_idle()
    dec = h.trace(ev.StepDecision)
    steps = {e.step: e for e in h.trace(ev.BatchStep)}
    assert dec and all(d.start_ts > 0 for d in dec)
    for d, nxt in zip(dec, dec[1:]):
        assert d.start_ts <= d.ts <= nxt.start_ts  # one step after the other
    if not overlap:  # the batch.step comes within its own step
        assert all(d.start_ts <= steps[d.step].ts <= d.ts for d in dec)


def test_request_detail_and_gantt_show_the_parts():
    from workbench.tui.model import TuiModel
    from workbench.tui.panels.detail import render_detail
    from workbench.widgets import data as D

    model = TuiModel()
    model.apply(_seen_cases())
    text = render_detail(model, "a").plain
    assert "TTFT 8.94 s = the parts below" in text
    for line in (
        "6.65 s arrived → queued the scheduler was inside step 1",
        "2.04 s queued           passed over by 2 steps",
        "50.0 ms first token",
    ):
        assert " ".join(line.split()) in " ".join(text.split())
    assert "1 step (step 5)" in text and "1 steps" not in text
    st = model.state
    g = D.gantt_data(st, D.time_origin(st))
    assert g.ttft["a"][0] == st.ttft_parts("a").summary()
    queued = next(s for s in g.spans if s.rid == "a" and s.kind == "queued")
    assert queued.detail.splitlines() == g.ttft["a"][1:3]
    assert D.request_details(st, "a")["ttft_parts"] == g.ttft["a"]
