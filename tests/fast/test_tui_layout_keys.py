"""Issue #40 items 8 and 9: the layout follows the terminal's size, and no key leaves the user
stuck in a text box (replays of the recorded fixture; no engine)."""

from __future__ import annotations

from textual.widgets import Footer, Input
from tui_helpers import FIXTURE, show_at, wait_for
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
