"""The step history: any scheduler step opened to read its whole decision, `[` / `]` to walk back
and forth over the steps the trace still holds, live or replaying.

Opened with `h` (the newest step, or the step a "pause on" stopped at), by Enter on a Batch
composition row (that step), or by the app at a given step. It reads only the app's TuiModel
(TraceState.steps and TraceState.describe): what it shows is what the trace says.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Static
from workbench.core.trace.views import StepView


class StepOpened(Message):
    """A view asks to open one step in the step history (`proc`, `step`)."""

    def __init__(self, proc: str, step: int) -> None:
        super().__init__()
        self.proc = proc
        self.step = step


def render_step(rows: list[tuple[str, str]], width: int = 16) -> Text:
    """A step's decision rows (TraceState.describe) as aligned `heading  text` lines."""
    t = Text()
    for heading, text in rows:
        t.append(f"{heading:<{width}}", style="bold")
        t.append(f" {text}\n")
    return t


class StepHistoryScreen(ModalScreen):
    """One step's whole decision; `[` / `]` the previous / next step, End the newest (and follow
    it as new steps come), Esc closes. Pause and step (`p`, `s`) keep working."""

    BINDINGS = [
        Binding("escape,h,q", "dismiss", "close"),
        Binding("left_square_bracket", "walk(-1)", "prev step"),
        Binding("right_square_bracket", "walk(1)", "next step"),
        Binding("end", "newest", "newest"),
        # a modal screen takes the keys: pause and step reach the app from here too
        Binding("p", "app.toggle_pause", "pause/run"),
        Binding("s", "app.step", "step"),
    ]
    DEFAULT_CSS = """
    StepHistoryScreen { align: center middle; }
    StepHistoryScreen > VerticalScroll { width: 92%; height: 80%; border: thick $accent; background: $surface;
                                          padding: 0 1; }
    """

    def __init__(self, proc: str | None = None, step: int | None = None) -> None:
        super().__init__()
        # None: follow the newest step; else pinned on (proc, step) until `]` walks past the newest
        self.key: tuple[str, int] | None = (proc or "", step) if step is not None else None
        self.shown: StepView | None = None

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(id="history-body")

    def on_mount(self) -> None:
        self.redraw()
        self.set_interval(0.25, self.redraw)  # live: new steps, a decision that came after its step

    def _steps(self) -> list[StepView]:
        return list(self.app.model.state.steps)

    def _index(self, steps: list[StepView]) -> int | None:
        if not steps:
            return None
        if self.key is None:
            return len(steps) - 1
        proc, step = self.key
        for i in range(len(steps) - 1, -1, -1):
            sv = steps[i]
            if sv.step == step and (not proc or sv.proc == proc):
                return i
        return None

    def action_walk(self, delta: int) -> None:
        steps = self._steps()
        i = self._index(steps)
        if i is None:
            i = 0 if delta > 0 else len(steps) - 1
        else:
            i += delta
        if i >= len(steps) - 1:
            self.key = None  # past the newest: follow the live end again
        elif steps:
            i = max(0, i)
            self.key = (steps[i].proc, steps[i].step)
        self.redraw()

    def action_newest(self) -> None:
        self.key = None
        self.redraw()

    def redraw(self) -> None:
        model = self.app.model
        steps = self._steps()
        i = self._index(steps)
        t = Text()
        if i is None:
            self.shown = None
            if not steps:
                t.append("No scheduler step yet.", style="bold")
            else:
                t.append(
                    f"Step {self.key[1] if self.key else '?'} is no longer held (the trace keeps the last "
                    f"{len(steps)} steps: {steps[0].step}–{steps[-1].step}); End shows the newest.",
                    style="bold",
                )
        else:
            sv = self.shown = steps[i]
            where = "the newest, following new steps" if self.key is None else f"{len(steps) - 1 - i} before the newest"
            t.append(f"Step {sv.step}", style="bold underline")
            t.append(f"  ({where}; held: {steps[0].step}–{steps[-1].step})", style="dim")
            if model.paused:
                t.append("  ⏸ paused", style="bold")
            t.append("\n\n")
            t.append_text(render_step(model.state.describe(sv)))
        t.append("\n[ / ] previous / next step · End the newest · p pause/run · s one step · Esc close", style="dim")
        self.query_one("#history-body", Static).update(t)
