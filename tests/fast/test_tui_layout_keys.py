"""Issue #40 items 8 and 9: the layout follows the terminal's size, and no key leaves the user
stuck in a text box (replays of the recorded fixture; no engine)."""

from __future__ import annotations

from textual.widgets import Footer, Input
from tui_helpers import FIXTURE, replay_app, show_at, step_ts, wait_for
from workbench.core.trace.replay import Replay
from workbench.tui.app import WorkbenchApp
from workbench.tui.controller import ReplayController


class ChatReplay(ReplayController):
    """A replay that also takes chat prompts: a stand-in for a live engine, where the point is
    only what the app does with the keyboard focus around a prompt."""

    can_chat = True

    def chat(self, prompt, on_delta, cancelled, max_new_tokens=128):
        on_delta("chat-x", "an answer")
        return {}


def _footer_keys(app) -> str:
    return " ".join(str(c.render()) for c in app.query_one(Footer).children)


async def test_enter_leaves_the_prompt_and_global_keys_work_again():
    replay = Replay(FIXTURE)
    app = WorkbenchApp(ChatReplay(replay, autoplay=False), layout="tabs")
    async with app.run_test(size=(100, 30)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        await pilot.press("slash")
        assert isinstance(app.focused, Input)
        await pilot.press("h", "i", "enter")
        await wait_for(app.chat_done.is_set)
        await pilot.pause()
        assert not isinstance(app.focused, Input), "Enter left the focus in the prompt box"
        footer = _footer_keys(app)
        for key in ("q quit", "? help", "p pause", "s step"):
            assert key in footer, footer
        # the keys act again: a digit picks a panel, l switches the layout
        await pilot.press("3")
        await pilot.pause()
        assert list(app.visible_panels()) == ["tree"]
        await pilot.press("l")
        await pilot.pause()
        assert app.layout_mode == "grid"
        assert app.query_one("#prompt", Input).value == ""


async def test_digits_never_focus_a_text_box():
    replay = Replay(FIXTURE)
    app = WorkbenchApp(ChatReplay(replay, autoplay=False), layout="tabs")
    async with app.run_test(size=(100, 30)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        await pilot.press("l")
        await pilot.pause()
        assert app.layout_mode == "grid"
        # 6 is the Events panel, whose first focusable widget is its filter box: the digits after it
        # used to go into the filter instead of picking panels
        for key in "123456789":
            await pilot.press(key)
            await pilot.pause()
            assert not isinstance(app.focused, Input), f"{key} put the focus in a text box"
        await pilot.press("1")
        await pilot.pause()
        assert app.focused is not None and app.focused.id == "queues-table"
        assert "q quit" in _footer_keys(app)
        # f is the way into the filter; Enter leaves it, the filter kept
        await pilot.press("f")
        assert isinstance(app.focused, Input)
        await pilot.press("x", "enter")
        await pilot.pause()
        assert not isinstance(app.focused, Input)


# ---- item 8: the layout follows the terminal -------------------------------------------------


def _batch_steps(replay) -> list[int]:
    return [e.step for e in replay.events if type(e).__name__ == "BatchStep"]


async def test_auto_layout_follows_a_resize_until_the_user_picks_one():
    app, replay = replay_app(layout="auto")
    async with app.run_test(size=(160, 48)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        assert app.layout_mode == "grid"
        await pilot.resize_terminal(100, 30)
        await wait_for(lambda: app.layout_mode == "tabs")
        await pilot.resize_terminal(160, 48)
        await wait_for(lambda: app.layout_mode == "grid")
        await pilot.press("l")  # the user's choice stays, whatever the size
        await pilot.pause()
        await pilot.resize_terminal(170, 50)
        await pilot.pause(0.5)
        assert app.layout_mode == "tabs"


async def test_batch_composition_follows_the_newest_step_after_a_resize():
    app, replay = replay_app(layout="grid")
    steps = _batch_steps(replay)
    async with app.run_test(size=(160, 48)) as pilot:
        await show_at(app, pilot, replay, step_ts(replay, steps[len(steps) // 2]))
        table = app.query_one("#batch-table")
        await pilot.resize_terminal(150, 36)  # a smaller table: its scroll position is not at the end any more
        await pilot.pause(0.3)
        for s in steps[len(steps) // 2 + 1 :]:
            await show_at(app, pilot, replay, step_ts(replay, s))
        await pilot.pause(0.3)
        assert table.max_scroll_y > 0, "the test needs more steps than rows"
        assert table.scroll_y >= table.max_scroll_y - 1, "Batch composition stopped following the newest step"


async def test_queues_columns_fit_and_finished_rows_say_e2e():
    app, replay = replay_app(layout="auto")
    async with app.run_test(size=(160, 48)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        table = app.query_one("#queues-table")
        widths = sum(c.get_render_width(table) for c in table.columns.values())
        assert widths <= table.size.width, f"columns need {widths} cells, the table has {table.size.width}"
        labels = [c.label.plain for c in table.columns.values()]
        assert labels[-2:] == ["age/E2E", "TTFT"], labels
        # no row cursor dragged the table down: the first rows (waiting first) are the ones in view
        assert table.scroll_y == 0


async def test_notifications_cover_no_panel():
    app, replay = replay_app(layout="auto")
    async with app.run_test(size=(160, 48)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        app.notify("workload stopped", timeout=30)
        await pilot.pause()
        notice = app.query_one("#notice")
        assert notice.display and "workload stopped" in str(notice.render())
        assert not list(app.screen.query("Toast")), "a toast covers the panels"
