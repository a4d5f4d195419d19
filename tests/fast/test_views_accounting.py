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


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_prompt_is_cached_plus_computed_after_a_retraction(overlap):
    """Item 3: a retracted request's second prefill is `recomputed`, not added to `computed`."""
    h = _kv_pressure(overlap, radix=True)
    st = TraceState()
    st.apply_many(h.events)
    retracted = {e.rid for e in h.trace(ev.ReqRetracted)}
    assert retracted
    for r in st.requests.values():
        assert r.cached_tokens + r.computed_tokens == r.prompt_tokens, r
        assert (r.recomputed_tokens > 0) == (r.rid in retracted), r
    # a snapshot carries both counts
    fresh = TraceState()
    fresh.apply_many(st.snapshot_events())
    for rid in retracted:
        a, b = st.requests[rid], fresh.requests[rid]
        assert (a.computed_tokens, a.recomputed_tokens) == (b.computed_tokens, b.recomputed_tokens)


# ---- item 5: one definition of each time, paused time as its own part ---------------------------

S = 1_000_000_000


def _waiting_request_model(paused: bool):
    from workbench.tui.model import TuiModel

    m = TuiModel()
    m.apply(
        [
            ev.ReqArrived(ts=10 * S, proc="tokenizer", rid="w"),
            ev.ReqQueued(ts=10 * S + 2_000_000, proc="scheduler", step=3, rid="w", prompt_tokens=20, queue_len=1),
        ]
    )
    m.now_ns, m.paused = 41 * S, paused  # 31 s later, no event since
    return m


@pytest.mark.parametrize("paused", [True, False])
def test_ttft_so_far_is_now_minus_arrival_in_detail_and_queues(paused):
    from workbench.tui.panels.detail import render_detail
    from workbench.tui.panels.queues import queue_rows

    m = _waiting_request_model(paused)
    b = m.state.ttft_parts("w", now_ns=m.now_ns, paused=m.paused)
    assert b is not None and b.partial and b.ttft_ns == 31 * S  # the Queues' `31s…`
    assert b.parts[-1].kind == "paused" and b.parts[-1].label == ("paused" if paused else "no step since")
    text = render_detail(m, "w").plain
    assert "TTFT so far 31.00 s" in text, text
    if paused:
        assert "paused" in text
    (cells,) = [c for rid, c in queue_rows(m) if rid == "w"]
    assert str(cells[-1]).startswith("31")


def test_a_decode_run_across_a_pause_is_not_all_decode_time():
    from workbench.tui.model import TuiModel
    from workbench.tui.panels.detail import render_detail

    m = TuiModel()
    evs: list[ev.Event] = [ev.ReqArrived(ts=S, proc="tokenizer", rid="d")]
    for k in range(1, 7):  # 6 decode steps of 20 ms; 10 s paused between steps 3 and 4
        end = S + k * 30_000_000 + (10 * S if k >= 4 else 0)
        evs.append(
            ev.StepDecision(ts=end, proc="scheduler", step=k, mode="decode", kv_alloc=1, start_ts=end - 20_000_000)
        )
        evs.append(
            ev.BatchStep(
                ts=end,
                proc="scheduler",
                step=k,
                mode="decode",
                reqs=[ev.StepReq("d", decode=1)],
                batch_size=1,
                padded_size=1,
            )
        )
    m.apply(evs)
    m.now_ns = evs[-1].ts
    text = render_detail(m, "d").plain
    line = next(x for x in text.splitlines() if "decode " in x and "(steps " in x)
    assert "6 steps (steps 1–6)" in line and "between them" in line, line
    assert "120 ms in steps + 10050 ms between" in line, line  # 6 x 20 ms; from step 1 start to step 6 end


# ---- item 4: the header never suggests room that is not there -------------------------------------


def test_header_shows_held_cached_and_free():
    from workbench.tui.status import status_line

    st = TraceState()
    st.apply(ev.KVUsage(ts=5, proc="scheduler", step=146, used=180, evictable=450, free=10, total=640))
    wide = status_line("LIVE m", st, 5, ready=True, paused=False, width=300).plain
    assert "KV 28% held · 70% cached · 2% free" in wide and "used" not in wide
    narrow = status_line("LIVE m", st, 5, ready=True, paused=False, width=70).plain
    assert "KV 28% held · 2% free" in narrow  # the cached share is the rest of the pool
    st.apply(ev.KVUsage(ts=6, proc="scheduler", step=147, used=637, evictable=0, free=3, total=640))
    assert "KV >99% held · 0% cached · <1% free" in status_line("x", st, 6, ready=True, paused=False, width=300).plain


# ---- item 6: Events in time order, from the trace's start, keeping up -------------------------------


def test_events_are_in_time_order_and_an_early_note_is_at_the_start():
    from workbench.tui.model import TuiModel
    from workbench.tui.panels.events import format_line

    m = TuiModel()
    m.note("info", "engine starting")  # before any event: the reducer's clock is 0
    t0 = 1594_585_000_000
    m.apply([ev.ReqArrived(ts=t0, proc="tokenizer", rid="a")])
    m.apply([ev.ReqArrived(ts=t0 + 35_852_000_000, proc="tokenizer", rid="b")])
    m.apply([ev.CacheEvict(ts=t0 + 35_003_000_000, proc="scheduler", step=9, node_ids=[3], tokens=30)])  # late
    texts = [format_line(ln, m).plain for ln in m.log.lines]
    assert texts[0].startswith("   0.000s info") and "-1594" not in texts[0], texts
    stamps = [ln.ts for ln in m.log.lines]
    assert stamps == sorted(stamps)
    assert [ln.category for ln in m.log.lines][-2:] == ["evict", "arrive"]


async def test_events_panel_keeps_up_and_redraws_a_late_line_in_place():
    from textual.widgets import RichLog
    from tui_helpers import replay_app, show_at
    from workbench.tui.panels.events import EventsPanel

    app, replay = replay_app(panels=["events"])
    async with app.run_test(size=(140, 30)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        m = app.model
        end = m.state.last_ts
        # a flood: far more lines than one redraw renders
        m.apply([ev.ReqArrived(ts=end + i * 1000, proc="tokenizer", rid=f"f{i}") for i in range(1, 3001)])
        app.refresh_panels(force=True)
        await pilot.pause()
        log = app.query_one("#events-log", RichLog)
        assert len(log.lines) <= EventsPanel.MAX_LINES_PER_DRAW + 60  # bounded work (a line may wrap)
        assert "f3000 arrived" in log.lines[-1].text  # up to date
        # a late line (an eviction stamped before the last arrivals) goes where its time is
        m.apply([ev.CacheEvict(ts=end + 2999 * 1000 - 1, proc="scheduler", step=99, node_ids=[1], tokens=7)])
        app.refresh_panels(force=True)
        await pilot.pause()
        tail = [s.text for s in log.lines[-3:]]
        assert "evict" in tail[0] and "f2999 arrived" in tail[1] and "f3000 arrived" in tail[2], tail


# ---- item 7: `?` explains the step line's notation --------------------------------------------------


def test_every_part_of_the_step_line_is_explained():
    import re

    from workbench.core.trace.narration import STEP_LINE_HELP

    h = _kv_pressure(overlap=False, radix=True)
    st = TraceState()
    st.apply_many(h.events)
    words = {re.sub(r"[^a-zA-Z]", " ", term).split()[0] for term, _ in STEP_LINE_HELP if re.search("[a-zA-Z]", term)}
    words |= {w for term, _ in STEP_LINE_HELP for w in re.findall(r"[a-zA-Z]+", term)}
    for sv in st.steps:
        line = st.narrate(sv).split(": ", 1)[1]
        for part in line.split(" · "):
            first = re.findall(r"(?<!\w)[a-zA-Z]+(?!\w)", part)[0]  # a word, not a rid (r1)
            assert first in words, (first, part)


async def test_help_screen_explains_the_step_line():
    from textual.widgets import Static
    from tui_helpers import replay_app, show_at

    app, replay = replay_app(layout="tabs")
    async with app.run_test(size=(120, 40)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        await pilot.press("question_mark")
        await pilot.pause()
        body = app.screen.query_one("#help-body", Static).content.plain
        for term in ("budget a/b", "n running waited", "KV +a −b → h held", "finished rid (−n slots)", "evicted n"):
            assert term in body, term
        assert "held + cached + free" in body or "add up to the pool" in body
