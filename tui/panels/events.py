"""Events: a filterable log of arrivals, finishes, retractions, evictions, aborts and errors."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Input, RichLog
from workbench.core.trace.palette import EVICTED, RETRACTED, WAITING
from workbench.tui.model import LogLine, TuiModel
from workbench.tui.panels.base import TracePanel

_STYLE = {
    "arrive": f"italic {WAITING}",
    "finish": "bold",
    "abort": "bold red",
    "retract": f"bold {RETRACTED}",
    "evict": EVICTED,
    "drop": "bold red",
    "proc": "",
    "weights": "",
    "error": "bold white on red",
    "info": "dim",
}


def line_matches(line: LogLine, terms: list[str]) -> bool:
    """Every term must occur in the category or the text (case-insensitive); `-term` excludes."""
    hay = f"{line.category} {_step_label(line)}{line.text}".lower()
    for t in terms:
        if t.startswith("-") and len(t) > 1:
            if t[1:] in hay:
                return False
        elif t not in hay:
            return False
    return True


def _step_label(line: LogLine) -> str:
    """'step 12 ' for an event that belongs to a scheduler step (the Batch panel's step column)."""
    return f"step {line.step} " if line.step >= 0 else ""


def format_line(line: LogLine, model: TuiModel) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f"{model.rel_s(line.ts):8.3f}s ", style="dim")
    text.append(f"{line.category:<7} ", style=_STYLE.get(line.category, ""))
    text.append(_step_label(line), style="dim")
    style = "reverse" if line.rid is not None and line.rid == model.selected else ""
    text.append(line.text, style=style)
    return text


class EventsPanel(TracePanel):
    PANEL_NAME = "events"
    TITLE = "Events"
    HELP = (
        "Notable events in time order (a late event from another process takes its place by its "
        "time), newest at the bottom: arrivals, finishes (with TTFT/E2E), retractions, "
        "evictions, aborts, dropped trace events, process starts/exits and errors. `step N` names "
        "the scheduler step an event belongs to (a finish: the step of its last token), as in "
        "the Batch panel. Times are seconds since the trace began (a replay: since its first request, "
        "as its clock counts; start-up lines are negative). Type in the "
        "filter box (key f) to keep matching lines: words must all match, `-word` hides, e.g. "
        "`evict` or `-arrive`."
    )
    clock_interval_s = 0
    MAX_LINES_PER_DRAW = 200  # more than any terminal shows at once

    def compose(self) -> ComposeResult:
        yield Input(placeholder="filter (e.g. evict, abort, -arrive)", id="events-filter")
        yield RichLog(id="events-log", max_lines=1000, wrap=True, min_width=20, auto_scroll=True)

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._shown_seq = 0
        self._last_ts: int | None = None  # the newest line's ts when the log was last drawn
        self._terms: list[str] = []
        self._epoch = -1
        self._selected = None
        self._model: TuiModel | None = None

    @property
    def terms(self) -> list[str]:
        return self._terms

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._terms = event.value.lower().split()
        if self._model is not None:
            self._rewrite(self._model)

    def on_resize(self) -> None:
        # Lines are drawn at the log's width: draw them again at the new one (and at the first
        # layout, for lines written before the log knew its size).
        if self._model is not None:
            self._rewrite(self._model)

    def _rewrite(self, model: TuiModel) -> None:
        log = self.query_one(RichLog)
        log.clear()
        self._shown_seq = 0
        self._last_ts = None
        self._append(model)

    def _append(self, model: TuiModel) -> None:
        """Write the lines not shown yet. The log is in time order and a late line may belong
        before lines already written: then the tail is drawn again. Either way at most
        MAX_LINES_PER_DRAW lines are rendered per redraw (the newest), so under load the panel
        keeps up with the header instead of falling behind by whole seconds of events."""
        log = self.query_one(RichLog)
        # Render each line at the log's own width (0 before the first layout: RichLog defers it);
        # left to itself RichLog measures against the console's width, not the panel's.
        width = log.scrollable_content_region.width or None
        lines = model.log.lines
        new = [ln for ln in lines if ln.seq > self._shown_seq]
        if new:
            late = self._last_ts is not None and new[0].ts < self._last_ts
            if late or len(new) > self.MAX_LINES_PER_DRAW:
                log.clear()
                new = [ln for ln in lines if line_matches(ln, self._terms)][-self.MAX_LINES_PER_DRAW :]
            else:
                new = [ln for ln in new if line_matches(ln, self._terms)]
            for line in new:
                log.write(format_line(line, model), width=width)
            self._shown_seq = max(ln.seq for ln in lines)
            self._last_ts = lines[-1].ts
        self.border_title = f"Events — {len(lines)}" + (f" · filter: {' '.join(self._terms)}" if self._terms else "")

    def update_view(self, model: TuiModel) -> None:
        self._model = model
        if model.epoch != self._epoch or model.selected != self._selected:
            self._epoch, self._selected = model.epoch, model.selected
            self._rewrite(model)
        else:
            self._append(model)
