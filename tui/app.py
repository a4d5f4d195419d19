"""WorkbenchApp: the Textual app that shows the serving pipeline live, steps it, and replays it.

Data flow: a timer (~10 Hz) drains the controller's event source, folds the
events into one `TuiModel` (TraceState + events log) and asks each visible
panel to redraw from it. Panels never see the engine; interaction (pause,
step, chat, workloads) goes through the controller, on a worker thread when
the call can block.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, Vertical
from textual.css.query import NoMatches
from textual.widget import Widget
from textual.widgets import Footer, Input, LoadingIndicator, Static, TabbedContent
from textual.worker import get_current_worker
from workbench.core.trace import events as ev
from workbench.core.trace.palette import PALETTE
from workbench.core.trace.startup import StartupProgress
from workbench.tui.controller import Controller, friendly
from workbench.tui.fmt import shorten
from workbench.tui.history import StepHistoryScreen, StepOpened
from workbench.tui.layout import GRID_MIN_SIZE, mount_layout
from workbench.tui.model import TuiModel
from workbench.tui.panels.base import RequestSelected
from workbench.tui.pause_on import KIND_NAMES, PauseOnScreen, PauseTrigger, pause_triggers, split_after_step
from workbench.tui.startup import phase_lines, startup_body, startup_title
from workbench.tui.status import status_line
from workbench.tui.tour import STOPS, TourGuide, TourStop
from workbench.tui.workload import KINDS


class WorkbenchApp(App):
    """The workbench TUI. `controller` is where events come from (live engine, replay, attach).

    Args:
        panels: panel names to show, in order (default: every registered panel).
        registry: a PluginRegistry (default: `load_plugins()`).
        layout: "grid" (one screen), "tabs" (one tab per panel) or "auto" (by terminal size).
        refresh_hz: panel redraw rate (events are folded at the same rate).
        select: a rid to select at start.
        tour: the guided tour (tui/tour.py): pause at each of its stops, `n` goes on.
        pause_on: kinds of event that pause the scheduler when they happen (tui/pause_on.py:
            retract, evict, chunk, preempt); `o` changes them, `h` opens the step it paused at.
    """

    TITLE = "Serving Workbench"
    AUTO_FOCUS = None  # never start in the prompt box: single-key bindings must work at once
    CSS = """
    #status { height: auto; max-height: 2; background: $boost; padding: 0 1; }
    #laststep { height: auto; max-height: 2; padding: 0 1; }
    #startup { align: center middle; height: 1fr; }
    #startup-box { width: 80%; height: auto; max-height: 80%; border: round $accent; padding: 0 1; }
    #startup-spinner { height: 3; }  /* its default fills the box and hid the phases and the log */
    #startup-log { height: auto; }
    #main { height: 1fr; }
    .grid-row { height: 1fr; }
    #answer { height: auto; max-height: 6; padding: 0 1; background: $panel; }
    #notice { height: auto; max-height: 2; padding: 0 1; display: none; }
    #tour { height: auto; max-height: 4; padding: 0 1; background: $accent-darken-2; color: $text; }
    #pauseon { height: auto; max-height: 3; padding: 0 1; }
    #prompt { dock: bottom; }
    TabbedContent, TabPane { height: 1fr; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
        Binding("question_mark", "help", "help"),
        Binding("p", "toggle_pause", "pause/run"),
        Binding("s", "step", "step"),
        Binding("w", "toggle_workload", "workload on/off"),
        Binding("W", "cycle_workload", "kind", show=False),
        Binding("plus,equals_sign", "faster", "faster"),
        Binding("minus", "slower", "slower"),
        Binding("r", "restart", "restart"),
        Binding("slash", "focus_prompt", "prompt"),
        Binding("f", "focus_filter", "filter", show=False),
        Binding("left_square_bracket", "select(-1)", "prev req", show=False),
        Binding("right_square_bracket", "select(1)", "next req", show=False),
        Binding("l", "toggle_layout", "layout"),
        Binding("n", "tour_next", "next stop"),
        Binding("h", "step_history", "steps"),
        Binding("o", "pause_on_menu", "pause on"),
        Binding("escape", "escape", "back", show=False),
        *[Binding(str(i), f"panel({i})", show=False) for i in range(1, 10)],
    ]

    def __init__(
        self,
        controller: Controller,
        *,
        panels: list[str] | None = None,
        registry=None,
        layout: str = "auto",
        refresh_hz: float = 10.0,
        select: str | None = None,
        chat_max_new_tokens: int = 128,
        max_events_per_tick: int = 50_000,
        log_path: str | None = None,
        tour: bool = False,
        pause_on: set[str] | list[str] | tuple[str, ...] | None = None,
    ):
        super().__init__()
        if registry is None:
            from workbench.plugins import load_plugins

            registry = load_plugins()
        self.registry = registry
        self.controller = controller
        self.model = TuiModel()
        self.model.selected = select
        # a replay's events log counts from its first request, as its clock does
        self.model.t0_ns = getattr(controller, "origin_ns", None)
        names = list(panels) if panels else [n for n, spec in registry.panels.items() if spec.when is None]
        # Left out until the trace shows what they draw (the experts heatmap: a MoE model's first step).
        self._deferred = [] if panels else [n for n, spec in registry.panels.items() if spec.when is not None]
        unknown = [n for n in names if n not in registry.panels]
        if unknown:
            raise ValueError(f"unknown panel(s): {', '.join(unknown)}; available: {', '.join(registry.panels)}")
        self.panel_names = names
        self.layout_mode = layout
        self._auto_layout = layout == "auto"  # follow the terminal's size until the user picks one (l)
        self._notices: list[tuple[float, Text]] = []  # (shown until, text): the notice line
        self.refresh_hz = refresh_hz
        self.chat_max_new_tokens = chat_max_new_tokens
        self.max_events_per_tick = max_events_per_tick
        self.log_path = log_path
        self.panels: dict[str, Widget] = {}
        self.ready = threading.Event()  # the controller has started
        self.startup_error: str | None = None
        self.startup_traceback = ""
        self.chat_done = threading.Event()
        self.last_answer = ""
        self.last_step_result: int | None = None
        self.control_results = 0  # control commands completed (tests wait on it)
        self._progress: queue.SimpleQueue = queue.SimpleQueue()
        self._chat_q: queue.SimpleQueue = queue.SimpleQueue()
        self._control_q: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._progress_lines: list[str] = []
        self.startup = StartupProgress()  # the engine's start-up phases (engine.phase events)
        self._started_at = time.monotonic()
        self._last_tail: str | None = None  # None: the start-up box is not drawn yet
        self._chat_prompt = ""
        self._broken_panels: set[str] = set()
        self._remounting = False
        self._quitting = False
        self._kind_cycle = list(KINDS)
        self.tour = TourGuide() if tour else None
        self.tour_shown: list[TourStop] = []  # the stops shown so far (the last one is on screen)
        self._tour_queue: list[TourStop] = []  # reached, not shown yet (two stops in one step)
        self._tour_waiting = False  # a stop is on screen, waiting for `n`
        unknown_kinds = sorted(set(pause_on or ()) - set(KIND_NAMES))
        if unknown_kinds:
            raise ValueError(
                f"unknown pause-on kind(s): {', '.join(unknown_kinds)}; choose from {','.join(KIND_NAMES)}"
            )
        self.pause_on: set[str] = set(pause_on or ())
        self.paused_on: PauseTrigger | None = None  # the event the app paused at, until resumed
        self._pause_on_from = -1  # steps before this ran before the last resume: they never pause again
        # While paused on a step: the events of later steps (run before the pause landed), folded
        # only on resume or, one step at a time, on `s`.
        self._held_events: list = []
        self._hold_step: int | None = None

    def get_css_variables(self) -> dict[str, str]:
        """The theme's variables plus the colour language ($wb-cached, $wb-locked, ...: the palette
        in core/trace/palette.py), so CSS, built-in or a plugin panel's, speaks it too."""
        variables = super().get_css_variables()
        variables.update({f"wb-{name}": hex_ for name, hex_ in PALETTE.items()})
        return variables

    # ---- layout ---------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(id="status")
        yield Static(id="laststep")
        yield Static(id="tour")
        yield Static(id="pauseon")
        yield Static(id="notice")
        with Container(id="startup"):
            with Vertical(id="startup-box"):
                yield Static(Text("Starting…", style="bold"), id="startup-title")
                yield LoadingIndicator(id="startup-spinner")
                yield Static(id="startup-log")
        yield Container(id="main")
        yield Static(id="answer")
        yield Input(placeholder="/ to ask the model (Enter sends, Esc leaves)", id="prompt")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#main").display = False
        self.query_one("#answer").display = False
        self.query_one("#tour").display = self.tour is not None
        if self.tour is not None:
            self.query_one("#tour", Static).update(Text("guided tour: starting the engine…", style="bold"))
        self.query_one("#prompt").display = self.controller.can_chat
        self._pauseon_line = self.query_one("#pauseon", Static)
        self._show_pause_on()
        if self.layout_mode == "auto":
            self.layout_mode = self._layout_for_size()
        await self._mount_panels()
        self._update_status()
        threading.Thread(target=self._start_controller, name="tui-start", daemon=True).start()
        self.set_interval(1.0 / self.refresh_hz, self._tick)
        if self.controller.threaded:
            self._control_worker()

    def _layout_for_size(self) -> str:
        w, h = self.size
        return "grid" if (w >= GRID_MIN_SIZE[0] and h >= GRID_MIN_SIZE[1]) else "tabs"

    def _check_layout(self) -> None:
        # (from the 10 Hz tick) The layout chosen at start must follow the terminal: a grid squeezed
        # into 100×30 cuts every panel's labels and columns. Once the user picked one with `l`, it stays.
        if self._auto_layout and not self._remounting and self._layout_for_size() != self.layout_mode:
            self.call_after_refresh(self._relayout)

    async def _relayout(self) -> None:
        want = self._layout_for_size()
        if not self._auto_layout or want == self.layout_mode or self._remounting:
            return
        self.layout_mode = want
        await self._mount_panels()
        self.call_after_refresh(self.refresh_panels, True)

    def _make_panel(self, name: str) -> Widget:
        spec = self.registry.panels[name]
        try:
            widget = spec.factory()
        except Exception as exc:  # a broken plugin panel must not take the app down
            widget = Static(Text(f"panel {name!r} failed: {type(exc).__name__}: {exc}", style="red"))
        widget.id = f"panel-{name}"
        if not getattr(widget, "border_title", None):
            widget.border_title = spec.title
        return widget

    async def _mount_panels(self) -> None:
        # While the old widgets go and the new ones mount, a redraw would find half a panel and
        # mark it broken for good (seen when a deferred panel joined under a running workload).
        self._remounting = True
        try:
            main = self.query_one("#main")
            await main.remove_children()
            self.panels = {n: self._make_panel(n) for n in self.panel_names}
            self._broken_panels.clear()  # fresh widgets get a fresh chance
            titles = {n: self.registry.panels[n].title for n in self.panels}
            await mount_layout(main, self.panels, titles, self.layout_mode)
        finally:
            self._remounting = False

    def _reveal_deferred(self) -> None:
        """Add the deferred panels whose condition now holds, and lay the screen out again."""
        ready = [n for n in self._deferred if self._panel_wanted(n)]
        if ready:
            self._deferred = [n for n in self._deferred if n not in ready]
            self.panel_names += ready
            self.call_later(self._mount_panels)

    def _panel_wanted(self, name: str) -> bool:
        try:
            return bool(self.registry.panels[name].when(self.model.state))
        except Exception:  # a plugin's broken condition keeps its panel out, not the app down
            return False

    def visible_panels(self) -> dict[str, Widget]:
        if self.layout_mode == "tabs" and len(self.panels) > 1:
            try:
                active = self.query_one("#tabs", TabbedContent).active
            except Exception:
                return {}
            name = active[len("tab-") :] if active else ""
            return {name: self.panels[name]} if name in self.panels else {}
        return dict(self.panels)

    # ---- start-up ------------------------------------------------------------------
    def _start_controller(self) -> None:
        # A plain daemon thread: loading a model cannot be interrupted, and q must not wait for it.
        try:
            self.controller.start(self._progress.put)
        except BaseException as exc:  # SystemExit from a child helper must not look like success
            self.startup_error = friendly(exc) or type(exc).__name__
            import traceback

            self.startup_traceback = traceback.format_exc()
        finally:
            self._progress.put(None)

    def _drain_progress(self) -> None:
        changed = False
        while True:
            try:
                msg = self._progress.get_nowait()
            except queue.Empty:
                break
            changed = True
            if msg is None:
                if self.startup_error:
                    self._show_startup_error()
                else:
                    self._controller_ready()
            elif isinstance(msg, ev.EnginePhase):
                self.startup.apply(msg)
            else:
                self._progress_lines.append(msg)
        starting = not self.ready.is_set() and not self.startup_error
        if not starting:
            return
        # Loading a model can take a minute on a busy machine: show that time passes, and in what.
        waited = time.monotonic() - self._started_at
        self.query_one("#startup-title", Static).update(startup_title(self.startup, waited))
        tail = self._log_tail()
        if changed or tail != self._last_tail or self.startup.current is not None:  # the phase's time moves
            self._last_tail = tail
            body = startup_body(
                self.startup, time.monotonic_ns(), self._progress_lines, tail, self.log_path, self._box_width()
            )
            self.query_one("#startup-log", Static).update(body)

    def _box_width(self) -> int:
        try:
            return max(40, self.query_one("#startup-log", Static).size.width)
        except NoMatches:
            return 100

    def _log_tail(self) -> str:
        """The last line the engine's processes wrote to the log (e.g. the weight-loading bar)."""
        path = self.log_path or self.startup.log_path
        if not path:
            return ""
        try:
            with open(path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 4096))
                data = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        # the engine's own phase lines are on the screen already, drawn better
        lines = [x.strip() for x in data.replace("\r", "\n").split("\n") if x.strip() and "] phase " not in x]
        return shorten(lines[-1], 200) if lines else ""

    def _show_startup_error(self) -> None:
        self.query_one("#startup-spinner").display = False
        self.query_one("#startup-title", Static).update(Text("Could not start", style="bold red"))
        body = phase_lines(self.startup, time.monotonic_ns(), self._box_width())
        if self.startup.phases:
            body.append("\n")
        body.append("\n".join(self._progress_lines[-6:]) + "\n\n", style="dim")
        body.append(self.startup_error or "", style="bold")
        if self.log_path or self.startup.log_path:
            body.append(f"\n\nDetails: {self.log_path or self.startup.log_path}", style="dim")
        body.append("\n\nPress q to quit.", style="bold")
        self.query_one("#startup-log", Static).update(body)

    def _controller_ready(self) -> None:
        self.query_one("#startup").display = False
        self.query_one("#main").display = True
        self.ready.set()
        scenario = getattr(self.controller, "scenario", None)
        if scenario is not None:  # what this demo sets up and what to look for, in the events log
            self.model.note("info", scenario.describe())
            if self.tour is None:  # the tour says what happens, stop by stop, in its own line
                self.notify(scenario.describe(), title=f"scenario {scenario.name}", timeout=15)
        c = self.controller
        note = getattr(c, "start_note", "")
        if note:
            self.model.note("info", note)
            self.notify(note, timeout=20)
        elif c.can_workload and not getattr(c, "workload_running", False) and not c.paused:
            # an engine with nothing to do looks broken: say what starts something
            hint = "nothing is running yet: w starts a workload (W picks its kind), / asks the model"
            self.model.note("info", hint)
            self.notify(hint, timeout=20)
        if self.tour is not None and not self.tour_shown:
            self.query_one("#tour", Static).update(
                Text(f"guided tour: running until the first of {len(STOPS)} stops (a request waiting)…", style="bold")
            )
        self._tick()

    # ---- the 10 Hz loop ---------------------------------------------------------------
    def _tick(self) -> None:
        if self._quitting or not self.is_running:
            return
        try:
            self._tick_body()
        except NoMatches:
            pass  # the screen is being torn down (exit in progress)

    def _tick_body(self) -> None:
        self._check_layout()
        self._drain_progress()
        self._drain_results()
        if not self.ready.is_set():
            return
        try:
            events = self.controller.drain(self.max_events_per_tick)
        except Exception as exc:
            events = []
            self._error(f"event source failed: {friendly(exc)}")
        self.model.now_ns = self.controller.now_ns()
        self.model.paused = bool(getattr(self.controller, "paused", False))
        if self._held_events:
            events, self._held_events = self._held_events + events, []
        if self.pause_on and events and (self.paused_on is None or not self.controller.can_step):
            self._pause_on_feed(events)  # a source that cannot pause: each new event only retells the line
        if self._hold_step is not None and self.paused_on is not None:
            events, self._held_events = split_after_step(events, self._hold_step, self.paused_on.proc)
        self.model.apply(events)
        if self.tour is not None and events:
            self._tour_feed(events)
        if self._deferred:
            self._reveal_deferred()
        self._drain_chat()
        self.refresh_panels()
        self._update_status()

    def refresh_panels(self, force: bool = False) -> None:
        """Redraw the visible panels from the model (force: even if nothing changed)."""
        if self._remounting:
            return
        for name, widget in self.visible_panels().items():
            if name in self._broken_panels:
                continue
            try:
                if hasattr(widget, "refresh_view"):
                    widget.refresh_view(self.model, force)
                elif hasattr(widget, "update_view"):
                    widget.update_view(self.model)
            except Exception as exc:  # one bad panel is reported, the others keep going
                self._broken_panels.add(name)
                self._error(f"panel {name} failed: {type(exc).__name__}: {exc}")

    def _update_status(self) -> None:
        st = self.model.state
        status = self.query_one("#status", Static)
        width = status.content_size.width or max(20, self.size.width - 2)
        status.update(
            status_line(
                self.controller.status(),
                st,
                self.model.now_ns,
                ready=self.ready.is_set(),
                paused=self.controller.paused,
                width=width,
            )
        )
        line = st.last_step_line if self.ready.is_set() else ""
        last = self.query_one("#laststep", Static)
        last.display = bool(line)
        if line:
            last.update(Text.assemble(("last step ", "bold"), line))

    def notify(self, message, *, title: str = "", severity: str = "information", timeout=None, markup: bool = True):
        """Notifications go to a line of their own under the status line, for `timeout` seconds:
        a toast covered Queues or Request detail, the panels a reader is reading."""
        try:
            self.query_one("#notice", Static)
        except NoMatches:  # another screen (help) is in front: a toast there covers nothing
            return super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)
        style = "bold red" if severity == "error" else "bold"
        text = Text.assemble(
            (f"{title}: " if title else "", style), (str(message), style if severity != "information" else "")
        )
        now = time.monotonic()
        self._notices = [n for n in self._notices if n[0] > now][-1:] + [(now + (timeout or 5.0), text)]
        self._show_notices()
        self.set_timer((timeout or 5.0) + 0.05, self._show_notices)

    def _show_notices(self) -> None:
        now = time.monotonic()
        self._notices = [n for n in self._notices if n[0] > now]
        try:
            line = self.query_one("#notice", Static)
        except NoMatches:
            return
        line.display = bool(self._notices)
        if self._notices:
            line.update(Text("  ·  ").join(t for _, t in self._notices))

    def _error(self, msg: str) -> None:
        self.model.note("error", msg)
        self.notify(msg, severity="error", timeout=6)

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """Hide key bindings that mean nothing for this source (e.g. workloads while replaying)."""
        c = self.controller
        if action in ("toggle_workload", "cycle_workload"):
            return c.can_workload
        if action in ("faster", "slower"):
            return c.can_workload or c.mode == "replay"
        if action == "focus_prompt":
            return c.can_chat
        if action in ("toggle_pause", "step"):
            return c.can_step
        if action == "restart":
            return c.mode == "replay"
        if action == "tour_next":
            return self.tour is not None
        return True

    # ---- control (pause / step / workload) ------------------------------------------------
    @work(thread=True, group="control", exit_on_error=False)
    def _control_worker(self) -> None:
        """One thread runs blocking controller calls in order; it checks cancellation so q exits."""
        worker = get_current_worker()
        while not worker.is_cancelled:
            try:
                label, fn = self._control_q.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._results.put((label, fn(), None))
            except Exception as exc:
                self._results.put((label, None, friendly(exc)))

    def _control(self, label: str, fn: Callable) -> None:
        if not self.ready.is_set():
            self.notify("still starting…", timeout=2)
            return
        if self.controller.threaded:
            self._control_q.put((label, fn))
        else:
            try:
                self._results.put((label, fn(), None))
            except Exception as exc:
                self._results.put((label, None, friendly(exc)))
            self._tick()

    def _drain_results(self) -> None:
        while True:
            try:
                label, value, err = self._results.get_nowait()
            except queue.Empty:
                return
            self.control_results += 1
            if err:
                self._error(f"{label}: {err}")
            elif label == "step":
                self.last_step_result = value
            elif label.startswith("workload"):
                # a control may return its own report (what a stop aborted, the new rate)
                self.model.note("info", value if isinstance(value, str) else label)
                if isinstance(value, str):
                    self.notify(value, timeout=3)

    def action_toggle_pause(self) -> None:
        c = self.controller
        if self._tour_waiting:  # p on a tour stop goes on, as n does
            self.action_tour_next()
            return
        if not c.can_step:
            self.notify(f"pausing is not available in {c.mode} mode", severity="warning")
            return
        if c.paused:
            self._pause_on_release()
        self._control("pause" if not c.paused else "resume", lambda: c.set_paused(not c.paused))

    def action_step(self) -> None:
        c = self.controller
        if self._held_events and self._hold_step is not None:
            # paused on an event with later steps already run: show the next of them, not a new one
            self._hold_step += 1
            self._tick()
            return
        self._hold_step = None  # nothing held: from here the engine's own steps show as they come
        if not c.can_step:
            self.notify(f"stepping is not available in {c.mode} mode", severity="warning")
            return

        def step():
            if not c.paused:
                c.set_paused(True)
            return c.step()

        self._control("step", step)

    def action_toggle_workload(self) -> None:
        c = self.controller
        if not c.can_workload:
            self.notify(f"workloads need a live engine ({c.mode} mode)", severity="warning")
            return
        if getattr(c, "workload_running", False):
            # stopping aborts the workload's requests still in flight: say how many
            self._control(
                "workload stopped", lambda: f"workload stopped; {c.stop_workload()} of its requests in flight aborted"
            )
        else:
            self._control("workload started", lambda: c.start_workload() or f"workload started: {c.status()}")

    def action_cycle_workload(self) -> None:
        c = self.controller
        if not c.can_workload:
            return
        cur = c.workload if c.workload in self._kind_cycle else self._kind_cycle[-1]
        kind = self._kind_cycle[(self._kind_cycle.index(cur) + 1) % len(self._kind_cycle)]
        if getattr(c, "workload_running", False):
            self._control("workload started", lambda: c.start_workload(kind) or f"workload started: {c.status()}")
        else:
            c.workload = kind
            self.notify(f"workload kind: {kind} (w starts it)", timeout=3)

    def _change_rate(self, factor: float) -> None:
        c = self.controller
        if c.mode == "replay":
            c.set_speed(c.replay.speed * (2.0 if factor > 1 else 0.5))
            self._update_status()
        elif c.can_workload:
            self._control("workload load", lambda: c.change_load(factor))

    def action_faster(self) -> None:
        self._change_rate(1.5)

    def action_slower(self) -> None:
        self._change_rate(1 / 1.5)

    def action_restart(self) -> None:
        if self.controller.mode == "replay":
            self._held_events, self._hold_step, self.paused_on, self._pause_on_from = [], None, None, -1
            self._show_pause_on()
            self.controller.restart()
            self._tick()

    # ---- the guided tour ------------------------------------------------------------------
    def _tour_feed(self, events: list) -> None:
        stops = self.tour.feed(events)
        if not stops:
            return
        self._tour_queue += stops
        if not self._tour_waiting:
            self._tour_show_next()

    def _tour_show_next(self) -> None:
        stop = self._tour_queue.pop(0)
        self.tour_shown.append(stop)
        self._tour_waiting = True
        c = self.controller
        if c.can_step and not c.paused:
            self._control("pause", lambda: c.set_paused(True))
        self.model.note("info", stop.banner())
        more = "n: next stop" if stop.index < len(STOPS) else "n: go on (the tour is done; the scenario keeps running)"
        self.query_one("#tour", Static).update(
            Text.assemble(
                (f"tour {stop.index}/{len(STOPS)} · {stop.title}", "bold"),
                f" (step {stop.step}): ",
                stop.line,
                ("  ⏸ paused · " + more, "bold"),
            )
        )

    def action_tour_next(self) -> None:
        """`n`: the next stop already reached, or resume until it comes."""
        if self.tour is None:
            return
        if self._tour_queue:
            self._tour_show_next()
            return
        nxt = self.tour.next_name
        label = dict(STOPS).get(nxt or "", "")
        text = (
            f"tour: running until the next stop ({label}: {len(self.tour_shown) + 1}/{len(STOPS)})…"
            if nxt
            else "tour done: every case was seen; the scenario keeps running (p pauses, ? explains the panels)"
        )
        self.query_one("#tour", Static).update(Text(text, style="bold"))
        self._tour_waiting = False
        self._pause_on_release()
        c = self.controller
        if c.can_step:  # even if the stop's pause is still queued: the control thread keeps the order
            self._control("resume", lambda: c.set_paused(False))

    # ---- pause on (retract / evict / chunk / preempt) ---------------------------------------
    def _pause_on_feed(self, events: list) -> None:
        """Pause the scheduler at the first chosen event among `events`, and say why. While it is
        paused on one, later ones (steps that ran before the pause landed) wait for the resume."""
        if self.paused_on is not None and self.controller.can_step:
            return
        hits = [t for t in pause_triggers(events, self.pause_on) if t.step >= self._pause_on_from]
        if not hits:
            return
        hit = hits[0] if self.controller.can_step else hits[-1]  # no pause: the line tells the latest
        self.paused_on = hit
        c = self.controller
        if c.can_step:
            self._hold_step = hit.step  # the panels stop at this step, whatever runs before the pause lands
            if not c.paused:
                self._control("pause", lambda: c.set_paused(True))
        self.model.note("info", f"paused on {hit.kind} at step {hit.step}: {hit.line}")
        self._show_pause_on()

    def _pause_on_release(self) -> None:
        """The user goes on: the next chosen event pauses again, not one from a step already run."""
        if self.paused_on is None:
            return
        # the held steps come next and may pause again; steps already shown never do
        self._pause_on_from = self.paused_on.step + 1
        self.paused_on, self._hold_step = None, None
        self._show_pause_on()

    def _show_pause_on(self) -> None:
        line = getattr(self, "_pauseon_line", None)
        if line is None:
            return
        line.display = bool(self.pause_on) or self.paused_on is not None
        hit = self.paused_on
        if hit is not None:
            can = self.controller.can_step
            line.update(
                Text.assemble(
                    ("⏸ paused " if can else "seen ", "bold"),
                    (f"on {hit.kind} at step {hit.step}", "bold"),
                    f": {hit.line}",
                    (
                        "  · h opens the step · p resumes · o changes what pauses"
                        if can
                        else f"  · h opens the step ({self.controller.mode} mode cannot pause)",
                        "bold",
                    ),
                )
            )
        elif self.pause_on:
            kinds = ", ".join(k for k in KIND_NAMES if k in self.pause_on)
            line.update(Text(f"pause on: {kinds} (o changes, h opens any step)", style="dim"))

    def action_pause_on_menu(self) -> None:
        """`o`: the menu that picks what pauses the scheduler."""

        def chosen(kinds: set[str] | None) -> None:
            if kinds is None:
                return
            self.pause_on = set(kinds)
            if not kinds:
                self._pause_on_release()
            self._show_pause_on()
            self.notify("pause on: " + (", ".join(k for k in KIND_NAMES if k in kinds) or "nothing"), timeout=3)

        self.push_screen(PauseOnScreen(self.pause_on), chosen)

    # ---- the step history ------------------------------------------------------------------
    def action_step_history(self) -> None:
        """`h`: the step history, at the step a "pause on" stopped at, else at the newest step."""
        hit = self.paused_on
        self.push_screen(StepHistoryScreen(hit.proc, hit.step) if hit is not None else StepHistoryScreen())

    def on_step_opened(self, message: StepOpened) -> None:
        self.push_screen(StepHistoryScreen(message.proc, message.step))

    # ---- chat ---------------------------------------------------------------------------
    def on_input_submitted(self, event: Input.Submitted) -> None:
        # Enter leaves the box (the prompt's or the events filter's): q, l, digits and the rest are
        # keys again, and the footer shows them again (it hides what a focused Input would type).
        self.set_focus(None)
        if event.input.id != "prompt":
            return
        text = event.value.strip()
        event.input.value = ""
        if not text:
            return
        self.send_prompt(text)

    def send_prompt(self, text: str) -> None:
        """Send `text` as a chat message; the answer streams into the answer line and Request detail."""
        if not self.controller.can_chat:
            self.notify(f"chat needs a live engine ({self.controller.mode} mode)", severity="warning")
            return
        if not self.ready.is_set():
            self.notify("still starting…", timeout=2)
            return
        self.chat_done.clear()
        self.last_answer = ""
        self._chat_prompt = text
        ans = self.query_one("#answer", Static)
        ans.display = True
        ans.update(Text.assemble(("you: ", "bold"), shorten(text, 200), ("\nmodel: ", "bold"), ("…", "dim")))
        self._chat_worker(text)

    @work(thread=True, group="chat", exclusive=True, exit_on_error=False)
    def _chat_worker(self, text: str) -> None:
        worker = get_current_worker()
        try:
            self.controller.chat(
                text,
                lambda rid, d: self._chat_q.put(("delta", rid, d)),
                lambda: worker.is_cancelled,
                self.chat_max_new_tokens,
            )
            self._chat_q.put(("done", None, None))
        except Exception as exc:
            self._chat_q.put(("error", None, friendly(exc)))

    def _drain_chat(self) -> None:
        changed = False
        while True:
            try:
                kind, rid, data = self._chat_q.get_nowait()
            except queue.Empty:
                break
            changed = True
            if kind == "delta":
                if not self.last_answer and rid and self.model.selected != rid:
                    self.model.selected = rid  # follow the chat in Request detail
                self.last_answer += data
            elif kind == "error":
                self._error(f"chat: {data}")
                self.chat_done.set()
            else:
                self.chat_done.set()
        if changed:
            self.query_one("#answer", Static).update(
                Text.assemble(
                    ("you: ", "bold"),
                    shorten(self._chat_prompt, 200),
                    ("\nmodel: ", "bold"),
                    self.last_answer[-400:] or "…",
                )
            )

    # ---- selection, focus, layout -----------------------------------------------------------
    def on_request_selected(self, message: RequestSelected) -> None:
        self.select_request(message.rid)

    def select_request(self, rid: str | None) -> None:
        self.model.selected = rid
        self.refresh_panels()

    def action_select(self, delta: int) -> None:
        from workbench.tui.panels.queues import queue_rows

        order = [rid for rid, _ in queue_rows(self.model)]
        if not order:
            order = list(self.model.state.requests)
        if not order:
            return
        cur = self.model.selected
        i = order.index(cur) + delta if cur in order else (0 if delta > 0 else len(order) - 1)
        self.select_request(order[i % len(order)])

    def action_focus_prompt(self) -> None:
        if self.controller.can_chat:
            self.query_one("#prompt", Input).focus()

    def action_focus_filter(self) -> None:
        try:
            self.query_one("#events-filter", Input).focus()
        except Exception:
            pass

    def action_escape(self) -> None:
        if isinstance(self.focused, Input):
            self.set_focus(None)
        else:
            self.select_request(None)

    async def action_toggle_layout(self) -> None:
        self._auto_layout = False  # the user's choice from now on, whatever the terminal's size
        self.layout_mode = "tabs" if self.layout_mode == "grid" else "grid"
        await self._mount_panels()
        self.call_after_refresh(self.refresh_panels, True)

    def action_panel(self, i: int) -> None:
        names = list(self.panels)
        if not 1 <= i <= len(names):
            return
        name = names[i - 1]
        if self.layout_mode == "tabs" and len(names) > 1:
            self.query_one("#tabs", TabbedContent).active = f"tab-{name}"
            self.call_after_refresh(self.refresh_panels, True)
        else:
            # Never into a text box (the events filter): digits typed next would go into it, not
            # pick a panel; `/` and `f` are the ways into a box.
            w = self.panels[name]
            target = next((d for d in w.query("*") if d.focusable and not isinstance(d, Input)), None)
            if target is not None:
                target.focus()
            else:
                self.set_focus(None)

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self.call_after_refresh(self.refresh_panels, True)

    def action_help(self) -> None:
        from workbench.tui.help import HelpScreen

        rows = []
        for name in self.panel_names:
            spec = self.registry.panels[name]
            widget = self.panels.get(name)
            rows.append((name, spec.title, getattr(widget, "HELP", "") or spec.help))
        self.push_screen(HelpScreen(rows, self.controller.status()))

    # ---- quitting ---------------------------------------------------------------------------
    async def action_quit(self) -> None:
        if self._quitting:
            return
        self._quitting = True
        self.query_one("#status", Static).update(Text("shutting down…", style="bold"))
        self.workers.cancel_all()
        await self._close_controller()
        self.exit()

    async def _close_controller(self) -> None:
        try:
            await asyncio.wait_for(asyncio.to_thread(self.controller.close), timeout=30)
        except Exception:
            pass  # run_tui closes again after exit; never hang here

    async def on_unmount(self) -> None:
        # However the app ends (q, ctrl+c, a test harness), the workload stops and an owned
        # engine shuts down; close() is idempotent.
        self._quitting = True
        await self._close_controller()
