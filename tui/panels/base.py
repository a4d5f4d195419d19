"""TracePanel: the base class of every panel (built-in or from a plugin).

A panel renders a `TuiModel` in `update_view(model)`; the app calls it up to
~10 times a second for visible panels only. `min_interval_s` throttles heavy
panels further, and `needs_update` skips the work when nothing changed.
"""

from __future__ import annotations

from textual.containers import Vertical
from textual.message import Message
from workbench.tui.model import TuiModel


class RequestSelected(Message):
    """A panel asks the app to select a request (rid), shown in Request detail."""

    def __init__(self, rid: str) -> None:
        super().__init__()
        self.rid = rid


class TracePanel(Vertical):
    """Base panel: a bordered box titled `TITLE`; subclasses fill `update_view`."""

    PANEL_NAME = ""
    TITLE = ""
    HELP = ""
    #: redraw at most this often even when events keep coming (age columns need time, too)
    min_interval_s = 0.1
    #: redraw when only the clock moved, at most this often (0: never)
    clock_interval_s = 1.0

    DEFAULT_CSS = """
    TracePanel {
        border: round $panel-lighten-2;
        border-title-color: $text;
        border-title-style: bold;
        height: 1fr;
        width: 1fr;
        padding: 0 1;
    }
    TracePanel:focus-within { border: round $accent; }
    """

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.border_title = self.TITLE
        self._seen_version = -1
        self._seen_selected: object = object()
        self._seen_epoch = -1
        self._last_draw_ns = -(10**18)
        self._last_clock_ns = -(10**18)
        self.panel_ready = False

    def on_mount(self) -> None:
        # Children from compose() are mounted by now; before this, queries would fail.
        self.panel_ready = True

    def needs_update(self, model: TuiModel, force: bool = False) -> bool:
        """True when the panel should redraw now (new events, new selection, time moved)."""
        if force or model.selected != self._seen_selected or model.epoch != self._seen_epoch:
            return True
        if model.version != self._seen_version:
            return model.now_ns - self._last_draw_ns >= self.min_interval_s * 1e9 or model.now_ns < self._last_draw_ns
        return bool(self.clock_interval_s) and model.now_ns - self._last_clock_ns >= self.clock_interval_s * 1e9

    def mark_drawn(self, model: TuiModel) -> None:
        self._seen_version, self._seen_selected, self._seen_epoch = model.version, model.selected, model.epoch
        self._last_draw_ns = self._last_clock_ns = model.now_ns

    def refresh_view(self, model: TuiModel, force: bool = False) -> None:
        """Called by the app: redraws via `update_view` when `needs_update` says so."""
        if self.panel_ready and self.needs_update(model, force):
            self.update_view(model)
            self.mark_drawn(model)

    def update_view(self, model: TuiModel) -> None:  # pragma: no cover - abstract
        raise NotImplementedError
