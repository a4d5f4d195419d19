"""Browsable narration (issue #40 build 2), on the recording of the `tour` scenario
(tests/data/tour_trace.jsonl: chunked prefills at steps 1-2, evictions at 17, 19 and 21, a
retraction at 24):

- any step opens to its whole decision (TraceState.describe): from the step history (`h`, `[` / `]`),
  from a Batch composition row (Enter) and from a bar of the Dashboard's batch chart (a click);
- "pause on" pauses the replay at the chosen event, says why, and goes on at `p`; `o` picks the kinds;
- evicted radix nodes stay a few steps as ghosts in the tree panel and the icicle.
"""

from __future__ import annotations

import os

import pytest
from tui_helpers import replay_app, show_at, step_ts, wait_for
from workbench.core.trace import events as ev
from workbench.core.trace.recorder import load_trace
from workbench.core.trace.state import GHOST_NS, GHOST_STEPS, TraceState

TOUR_TRACE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tour_trace.jsonl")


def _state_through(events, step: int) -> TraceState:
    """The reducer after every event up to and including the batch.step `step`."""
    st = TraceState()
    for e in events:
        st.apply(e)
        if isinstance(e, ev.BatchStep) and e.step == step:
            break
    return st


def _decision(events, step: int) -> ev.StepDecision:
    return next(e for e in events if isinstance(e, ev.StepDecision) and e.step == step)


def test_a_step_opens_to_every_part_of_its_decision():
    events = load_trace(TOUR_TRACE)
    st = TraceState()
    st.apply_many(events)
    by_step = {sv.step: sv for sv in st.steps}
    evict = _decision(events, 17)
    rows = dict(st.describe(by_step[17]))
    assert rows["in one line"] == st.narrate(by_step[17])
    # every evicted node by id, with its text where the trace knows it (the ghosts remember)
    assert all(f"#{n}" in rows["evicted"] for n in evict.evicted_nodes), rows
    assert rows["evicted"].startswith(f"{evict.evicted} cached tokens freed")
    assert rows["waiting"].startswith(f"{evict.waiting} left waiting") and evict.stop_rid in rows["waiting"]
    retract = _decision(events, 24)
    rows = dict(st.describe(by_step[24]))
    key = next(k for k in rows if k.startswith("retracted"))
    assert all(rid in rows[key] for rid in retract.retracted)
    # a step that admitted many names them all (the one-line narration cuts past three)
    many = max((sv for sv in st.steps if sv.decision is not None), key=lambda sv: len(sv.decision.admitted))
    rows = dict(st.describe(many))
    assert all(rid in rows[f"admitted ({len(many.decision.admitted)})"] for rid in many.decision.admitted)
    assert f"{many.batch_size}" in rows["step"] and len(many.reqs) == int(rows_key(rows, "batch"))


def rows_key(rows: dict, prefix: str) -> str:
    """`batch (6)` → "6"."""
    k = next(k for k in rows if k.startswith(prefix + " ("))
    return k[len(prefix) + 2 : -1]


def test_evicted_nodes_stay_as_ghosts_for_a_few_steps_in_the_tree_and_the_icicle():
    from workbench.tui.panels.tree import render_tree
    from workbench.widgets.data import tree_data

    events = load_trace(TOUR_TRACE)
    evicted = _decision(events, 17).evicted_nodes
    st = _state_through(events, 18)  # step 18's snapshot no longer lists them
    assert not set(evicted) & set(st.tree)
    shown = st.display_tree()
    assert set(evicted) <= set(shown)
    assert all(shown[n].just_evicted and shown[n].evicted_step == 17 for n in evicted)
    for n in evicted:  # hung in the tree: its parent (a ghost or a cached node) lists it
        assert n in shown[shown[n].parent_id].children
    assert all(n not in st.tree[p].children for p in st.tree for n in evicted)  # the cache's own views untouched
    text = render_tree(shown, st.last_ts)[0].plain
    assert "evicted at step 17" in text, text
    d = tree_data(st)
    assert {str(n) for n in evicted} <= {i for i, s in zip(d.ids, d.states) if s == "evicted"}
    # gone once both GHOST_STEPS steps and GHOST_NS of trace time have passed
    end = TraceState()
    end.apply_many(events)
    last = end.steps[-1]
    for step in (17, 19, 21):
        ts = _decision(events, step).ts
        old = last.step - step > GHOST_STEPS and end.last_ts - ts > GHOST_NS
        ids = set(_decision(events, step).evicted_nodes) - set(end.tree)
        assert ids, step
        assert (not ids & set(end.display_tree())) == old, (step, old)


async def test_h_opens_the_newest_step_and_brackets_walk_the_steps():
    from workbench.tui.history import StepHistoryScreen

    app, replay = replay_app(TOUR_TRACE, layout="tabs")
    async with app.run_test(size=(140, 40)) as pilot:
        await show_at(app, pilot, replay, step_ts(replay, 20))
        await pilot.press("h")
        await wait_for(lambda: isinstance(app.screen, StepHistoryScreen))
        screen = app.screen
        body = lambda: str(screen.query_one("#history-body").render())  # noqa: E731
        assert screen.shown.step == 20 and "Step 20" in body() and "the newest" in body()
        await pilot.press("left_square_bracket", "left_square_bracket", "left_square_bracket")
        await pilot.pause()
        assert screen.shown.step == 17 and "Step 17" in body(), body()
        assert "evicted" in body() and "12 cached tokens freed" in body()
        # live: new steps come in while the reader stays on step 17
        replay.advance_to(step_ts(replay, 22))
        app._tick()
        screen.redraw()
        newest = app.model.state.steps[-1].step
        assert newest > 20 and screen.shown.step == 17 and f"{newest - 17} before the newest" in body(), body()
        await pilot.press("right_square_bracket")
        await pilot.pause()
        assert screen.shown.step == 18
        await pilot.press("end")
        await pilot.pause()
        assert screen.shown.step == newest and "following new steps" in body()
        await pilot.press("s")  # the app's keys work behind it: one more step, and the page follows it
        await wait_for(lambda: app.model.state.steps[-1].step == newest + 1)
        screen.redraw()
        assert screen.shown.step == newest + 1
        await pilot.press("escape")
        await wait_for(lambda: not isinstance(app.screen, StepHistoryScreen))


async def test_enter_on_a_batch_row_opens_that_step():
    from textual.widgets import DataTable
    from workbench.tui.history import StepHistoryScreen

    app, replay = replay_app(TOUR_TRACE, panels=["batch"], layout="grid")
    async with app.run_test(size=(140, 40)) as pilot:
        await show_at(app, pilot, replay, step_ts(replay, 24))
        table = app.query_one("#batch-table", DataTable)
        await wait_for(lambda: table.row_count >= 20)
        table.focus()
        row = next(i for i in range(table.row_count) if table.get_row_at(i)[0] == "21")
        table.move_cursor(row=row)
        await pilot.press("enter")
        await wait_for(lambda: isinstance(app.screen, StepHistoryScreen))
        assert app.screen.shown.step == 21
        assert "18 cached tokens freed" in str(app.screen.query_one("#history-body").render())


async def test_pause_on_evict_pauses_the_replay_says_why_and_p_goes_on_to_the_next():
    from workbench.core.trace.replay import Replay
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import ReplayController
    from workbench.tui.history import StepHistoryScreen

    ctl = ReplayController(Replay(TOUR_TRACE), autoplay=True, speed=16.0)
    app = WorkbenchApp(ctl, pause_on=["evict"], layout="tabs")
    async with app.run_test(size=(140, 40)) as pilot:
        await wait_for(app.ready.is_set)
        line = lambda: str(app.query_one("#pauseon").render())  # noqa: E731
        assert "pause on: evict" in line()
        await wait_for(lambda: app.paused_on is not None and ctl.paused, 30)
        assert app.paused_on.step == 17 and "paused on evict at step 17" in line(), line()
        assert "evicted 12 tokens (2 nodes)" in line()
        # the panels stop at step 17 even if the replay ran on a little before the pause landed
        assert max(sv.step for sv in app.model.state.steps) == 17
        await pilot.press("h")  # opens the step it paused at
        await wait_for(lambda: isinstance(app.screen, StepHistoryScreen))
        assert app.screen.shown.step == 17
        await pilot.press("escape")
        await pilot.press("p")
        await wait_for(lambda: app.paused_on is not None and app.paused_on.step > 17 and ctl.paused, 30)
        assert app.paused_on.step == 19, app.paused_on


async def test_steps_run_before_the_pause_landed_are_held_back_and_s_shows_them_one_by_one():
    app, replay = replay_app(TOUR_TRACE, layout="grid", panels=["tree", "batch"], pause_on=["evict"])
    async with app.run_test(size=(160, 48)) as pilot:
        # the replay released through step 20 at once, as a scheduler that ran on a little would
        await show_at(app, pilot, replay, step_ts(replay, 20))
        newest = lambda: app.model.state.steps[-1].step  # noqa: E731
        tree = lambda: str(app.query_one("#tree-body").render())  # noqa: E731
        assert app.paused_on is not None and app.paused_on.step == 17 and newest() == 17
        # the step's snapshot dropped the evicted nodes from the cache: the tree keeps them as ghosts
        assert app.model.state.ghosts["scheduler"] and not set(app.model.state.ghosts["scheduler"]) & set(
            app.model.state.tree
        )
        await wait_for(lambda: "evicted at step 17" in tree())
        await pilot.press("s")
        await wait_for(lambda: newest() == 18)
        app.refresh_panels(force=True)
        await pilot.pause()
        assert "evicted at step 17" in tree()  # still there a step later
        assert app.paused_on.step == 17  # still paused on it: s walks the steps already run
        await pilot.press("p")  # go on: the held steps come, and the next eviction (19) pauses again
        await wait_for(lambda: app.paused_on is not None and app.paused_on.step == 19, 20)
        await wait_for(lambda: app.controller.paused)
        assert newest() == 19


async def test_o_picks_what_pauses_and_nothing_pauses_without_it():
    from workbench.tui.pause_on import PauseOnScreen

    app, replay = replay_app(TOUR_TRACE, layout="tabs")
    async with app.run_test(size=(140, 40)) as pilot:
        await show_at(app, pilot, replay, step_ts(replay, 18))
        assert app.paused_on is None and not app.query_one("#pauseon").display  # evictions seen, none chosen
        await pilot.press("o")
        await wait_for(lambda: isinstance(app.screen, PauseOnScreen))
        await pilot.press("r", "e", "c", "c")
        await pilot.press("escape")
        await wait_for(lambda: not isinstance(app.screen, PauseOnScreen))
        assert app.pause_on == {"retract", "evict"}
        assert "pause on: retract, evict" in str(app.query_one("#pauseon").render())
        await show_at(app, pilot, replay, step_ts(replay, 20))
        assert app.paused_on is not None and (app.paused_on.kind, app.paused_on.step) == ("evict", 19)


def test_the_pause_on_flag_parses_and_an_unknown_kind_says_the_choices():
    import argparse

    from workbench.core.trace.replay import Replay
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.cli import add_tui_args
    from workbench.tui.controller import ReplayController
    from workbench.tui.pause_on import parse_pause_on

    parser = argparse.ArgumentParser()
    add_tui_args(parser)
    args = parser.parse_args(["--pause-on", "retract,evict"])
    assert parse_pause_on(args.pause_on) == {"retract", "evict"}
    with pytest.raises(ValueError, match="choose from retract,evict,chunk,preempt"):
        parse_pause_on("retract,oom")
    with pytest.raises(ValueError, match="choose from"):
        WorkbenchApp(ReplayController(Replay(TOUR_TRACE)), pause_on=["oom"])


def test_a_click_on_the_dashboards_batch_chart_shows_that_steps_decision():
    from plotly.callbacks import Points
    from workbench.widgets.views import BatchView

    view = BatchView(load_trace(TOUR_TRACE))
    assert "click a bar" in view.details.value
    bars = view.figure.data[1]  # prefill computed
    i = list(bars.x).index(24)
    view._on_click(bars, Points(point_inds=[i], xs=[24], ys=[bars.y[i]], trace_name=bars.name, trace_index=1), None)
    assert view.selected_step == 24
    assert "retracted" in view.details.value and "sp-8" in view.details.value


async def test_attached_it_cannot_pause_but_says_each_event_it_saw():
    from workbench.core.trace.bus import TraceBus
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import AttachController

    bus = TraceBus("tcp://127.0.0.1:*", publish_addr="tcp://127.0.0.1:*", model="tour")
    events = load_trace(TOUR_TRACE)
    app = WorkbenchApp(AttachController(bus.publish_endpoint), pause_on=["evict"], layout="tabs")
    try:
        async with app.run_test(size=(140, 40)) as pilot:
            await wait_for(lambda: app.ready.is_set() and bus.listener_count == 1)
            bus.publish_batch([e for e in events if e.step <= 18])
            await wait_for(lambda: app.paused_on is not None)
            assert "seen on evict at step 17" in str(app.query_one("#pauseon").render())
            bus.publish_batch([e for e in events if e.step > 18])  # nothing held back: every step shows
            await wait_for(lambda: app.model.state.steps and app.model.state.steps[-1].step == 26, 20)
            assert app.paused_on.step == 21  # the line follows the evictions it cannot stop at
            await pilot.press("q")
        await wait_for(lambda: bus.listener_count == 0)
    finally:
        bus.close()
