"""The `?` screen: key bindings, the colour key (real swatches) and an explanation of each panel."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static
from workbench.core.trace.narration import STEP_LINE_HELP
from workbench.core.trace.palette import MEANINGS, PALETTE

KEYS = (
    ("q", "quit (stops workloads, shuts the engine down)"),
    ("?", "this help (Esc closes)"),
    ("p", "pause / resume the scheduler and the workload's arrivals with it (replay: pause / play)"),
    ("s", "single-step: run exactly one scheduler iteration (pauses first; nothing new arrives meanwhile)"),
    (
        "w / W",
        "start or stop the workload (stopping aborts its requests still in flight) / switch to a "
        "plain workload kind (chat, shared-prefix, long-prompt, burst)",
    ),
    (
        "+ / -",
        "workload rate ×1.5 / ÷1.5; a scenario's adaptive rate: requests kept in flight ×1.5 / ÷1.5 "
        "(replay: speed ×2 / ÷2)",
    ),
    ("r", "replay: back to the start"),
    ("/", "type a chat prompt (Enter sends, Esc leaves the box)"),
    ("f", "filter the events log"),
    ("[ / ]", "select the previous / next request (Request detail follows); in the step history: previous / next step"),
    (
        "h",
        "the step history: a step's whole decision (the newest, or the one a pause-on stopped at; Enter on a "
        "Batch composition row opens that step); [ / ] walk the steps, End the newest, Esc closes",
    ),
    (
        "o",
        "pause on: pause the scheduler when a retract, evict, chunked prefill or preempt happens "
        "(--pause-on retract,evict at start); the line under the status says why, p goes on, s shows the steps held back",
    ),
    ("l", "switch layout: all panels on one screen / one tab per panel"),
    ("1…9", "tabs: show panel N; grid: focus panel N"),
    ("Esc", "leave a text box, or clear the selection"),
)


def colour_key() -> Text:
    """One line per meaning: a swatch drawn in its colour, its name, what it means (the same
    colours every panel and the Jupyter widgets use: workbench.core.trace.palette)."""
    t = Text()
    for name, hex_ in PALETTE.items():
        t.append("  ")
        t.append("███", style=hex_)
        t.append(f" {name:<10}", style=f"bold {hex_}")
        t.append(f" {MEANINGS[name]}\n")
    return t


def step_line_key() -> Text:
    """The notation of the narrated step (`step 62 extend: admitted 11 … · KV +11 → 120 held · …`):
    one line per term, as TraceState.narrate writes it (core/trace/narration.py)."""
    t = Text()
    t.append("  One line per scheduler step, parts joined by ·:\n", style="dim")
    for term, meaning in STEP_LINE_HELP:
        t.append(f"  {term}", style="bold")
        t.append(f"  {meaning}\n")
    return t


class HelpScreen(ModalScreen):
    """Key bindings plus each panel's help text."""

    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90%; height: 90%; border: thick $accent; background: $surface;
                                  padding: 0 2; }
    """

    def __init__(self, panels: list[tuple[str, str, str]], mode_line: str = "") -> None:
        super().__init__()
        self._panels = panels
        self._mode = mode_line

    def compose(self) -> ComposeResult:
        t = Text()
        t.append("Serving Workbench — what you are looking at\n", style="bold underline")
        if self._mode:
            t.append(self._mode + "\n", style="dim")
        # the colour key first: it is what a newcomer looks up, and it stays on the first screen however
        # many keys the list below grows by
        t.append("\nColours (the same in every panel and in the Jupyter widgets)\n", style="bold")
        t.append_text(colour_key())
        t.append("\nKeys\n", style="bold")
        for k, what in KEYS:
            t.append(f"  {k:<8}", style="bold")
            t.append(what + "\n")
        from workbench.tui.status import STATUS_HELP

        t.append("\nStatus line (top)\n", style="bold")
        t.append(STATUS_HELP)
        t.append("\nThe step line (`last step`)\n", style="bold")
        t.append_text(step_line_key())
        t.append("\nPanels\n", style="bold")
        for i, (name, title, help_text) in enumerate(self._panels, 1):
            t.append(f"  {i}. {title}", style="bold underline")
            t.append(f"  ({name})\n", style="dim")
            t.append(f"     {help_text}\n")
        t.append("\nEvery panel reads only the trace (TraceState); nothing here pokes into the engine.", style="dim")
        with VerticalScroll():
            yield Static(t, id="help-body")
