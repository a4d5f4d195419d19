"""TraceFeed: one TraceState fed from a live engine, a subscription, a recording or a list of events,
re-rendering the views attached to it at most `max_hz` times a second.

Live sources are drained by a daemon thread; the thread folds every event
into the state as it comes but renders only when something changed and at
least 1/max_hz has passed since the last render, so a busy engine costs the
kernel a few figure updates a second, not one per event. Renders and folds
share one lock, so a render never sees a half-applied batch and a notebook
cell may call `refresh()` or `flush()` at any time.

Recordings (and lists of events) become a `Replay`: nothing moves on its own;
`seek_step(k)` / `seek(ts)` position it (the Dashboard's Play/slider drive these).
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from workbench.core.trace.events import BatchStep, Event, TraceReset
from workbench.core.trace.replay import Replay
from workbench.core.trace.state import TraceState
from workbench.widgets.data import time_origin

logger = logging.getLogger(__name__)

#: Held while views render, and (see views.TraceFigure) while the kernel applies a message from
#: the browser to a figure: the two must never interleave, or a figure update is lost.
RENDER_LOCK = threading.RLock()
#: Live feeds re-send whole figures this often, and twice more after the events stop.
KEYFRAME_INTERVAL_S = 2.0
IDLE_KEYFRAMES = 2


class TraceFeed:
    """Keeps a TraceState current and renders attached views, throttled.

    Args:
        source: an Engine (or TraceBus: anything with `subscribe(with_snapshot=...)`),
            a Subscription-like object (`get`/`drain`), a Replay, a recording's path,
            a list of events, or a TraceState (static).
        max_hz: the most renders per second while live.
        start: start the pump thread for live sources (False: call `pump()` yourself).
        position: where a replay starts, "end" (the whole run) or "start" (empty).
        keep_events: also keep the last this-many folded events in `events` (0: none),
            for code that wants the raw trace (e.g. a request's sequence diagram).
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(
        self,
        source: Any,
        max_hz: float = 5.0,
        start: bool = True,
        position: str = "end",
        keep_events: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_hz = max_hz
        self.min_interval = 1.0 / max_hz if max_hz > 0 else 0.0
        self.clock = clock
        self.state = TraceState()
        self.t0: int | None = None
        self.renders = 0  # how many times the views were rendered
        self.events_applied = 0
        self.last_error: str | None = None
        self.engine = None
        self.replay: Replay | None = None
        self.subscription = None
        self._views: list = []
        self._lock = threading.RLock()
        self._dirty = False
        self._last_render = float("-inf")
        self._last_event = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step_release: list[int] = []
        self._last_keyframe = float("-inf")
        self._idle_keyframes = 0
        self.events: deque[Event] = deque(maxlen=keep_events or 1)
        self._keep = keep_events > 0

        if isinstance(source, TraceState):
            self.state = source
        elif isinstance(source, Replay):
            self._use_replay(source)
        elif isinstance(source, (str, os.PathLike)):
            self._use_replay(Replay(source))
        elif isinstance(source, (list, tuple)):
            self._use_replay(Replay(list(source)))
        elif hasattr(source, "drain") and hasattr(source, "get"):
            self.subscription = source
        elif hasattr(source, "subscribe"):
            self.engine = source if hasattr(source, "generate") else None
            self.subscription = source.subscribe(with_snapshot=True)
        else:
            raise TypeError(
                f"cannot read trace events from {type(source).__name__}: give an Engine, "
                "a subscription, a Replay, a recording's path, a list of events or a TraceState"
            )
        if self.subscription is not None and start:
            self.start()
        if self.replay is not None and position == "end":
            self.replay.seek(self.replay.end_ns)
            self.apply(self.replay.drain())

    @classmethod
    def of(cls, source: Any, **kw) -> TraceFeed:
        """`source` itself when it already is a feed, else a new feed over it."""
        return source if isinstance(source, TraceFeed) else cls(source, **kw)

    @property
    def live(self) -> bool:
        return self.subscription is not None

    # ---- views -----------------------------------------------------------------------

    def attach(self, view) -> Any:
        """Render `view` (an object with `update(state, t0)`, or a callable(state, t0))
        on every refresh, starting now."""
        with self._lock:
            self._views.append(view)
            # A keyframe: the first picture becomes the figure's state too, not only an update a
            # browser still loading the widget's code drops (issue #40 item 12).
            self._render_one(view, keyframe=True)
        return view

    def detach(self, view) -> None:
        with self._lock:
            if view in self._views:
                self._views.remove(view)

    def _origin(self) -> int:
        if self.t0 is None:
            self.t0 = time_origin(self.state)
        return self.t0 if self.t0 is not None else self.state.last_ts

    def _render_one(self, view, keyframe: bool = False) -> None:
        try:
            fn = getattr(view, "update", view)
            with RENDER_LOCK:
                fn(self.state, self._origin())
                if keyframe and hasattr(view, "keyframe"):
                    view.keyframe()
        except Exception as exc:  # a failing view must not stop the feed or the others
            self.last_error = f"{type(view).__name__}: {type(exc).__name__}: {exc}"
            logger.exception("view %s failed to render", type(view).__name__)

    def refresh(self, keyframe: bool = False) -> None:
        """Render every attached view from the current state, now.

        keyframe: also re-send each figure whole (see TraceView.keyframe), not just what changed."""
        with self._lock:
            now = self.clock()
            # While live, every few seconds a render re-sends everything, so a browser that
            # missed updates (one still loading the widget's code) catches up.
            keyframe = keyframe or (self.live and now - self._last_keyframe >= KEYFRAME_INTERVAL_S)
            for v in list(self._views):
                self._render_one(v, keyframe)
            self.renders += 1
            self._dirty = False
            self._last_render = now
            if keyframe:
                self._last_keyframe = now
                self._idle_keyframes = max(0, self._idle_keyframes - 1)

    def snapshot(self, views=("gantt", "batch", "radix"), name: str = "", **kw):
        """Static pictures (SVG) of `views` as the state is now, on this feed's time origin: a
        `widgets.static.Snapshot` that shows in a notebook's outputs and stays there. Call
        `flush()` first after a generate call, so the last steps are in. kw: see `static.snapshot`."""
        from workbench.widgets.static import snapshot

        with self._lock:  # the pump thread must not fold events into the state mid-drawing
            return snapshot(self.state, views, name=name, t0=self._origin(), **kw)

    # ---- folding -----------------------------------------------------------------------

    def apply(self, events: Iterable[Event]) -> int:
        """Fold events into the state (a trace.reset also resets the time origin)."""
        n = 0
        with self._lock:
            for e in events:
                if type(e) is TraceReset:
                    self.t0 = None
                self.state.apply(e)
                if self._keep:
                    self.events.append(e)
                n += 1
            if n:
                self.events_applied += n
                self._dirty = True
                self._last_event = self.clock()
                self._idle_keyframes = IDLE_KEYFRAMES
        return n

    def pump(self, timeout: float = 0.0) -> int:
        """Drain what the source has (waiting up to `timeout` s for the first event),
        fold it, and render if due. Returns the number of events folded."""
        n = 0
        if self.subscription is not None:
            first = self.subscription.get(timeout=timeout) if timeout else None
            batch = ([first] if first is not None else []) + self.subscription.drain()
            n = self.apply(batch)
        elif self.replay is not None:
            n = self.apply(self.replay.drain())
        since = self.clock() - self._last_render
        if self._dirty and since >= self.min_interval:
            self.refresh()
        elif not self._dirty and self._idle_keyframes and self.live and since >= KEYFRAME_INTERVAL_S / 2:
            self.refresh(keyframe=True)  # settle the browser once the run is over
        return n

    def start(self) -> None:
        if self._thread is None and self.subscription is not None:
            self._thread = threading.Thread(target=self._run, name="workbench-widgets-feed", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.pump(timeout=min(0.1, self.min_interval or 0.1))
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.exception("trace feed failed")
                time.sleep(0.2)
            if getattr(self.subscription, "closed", False):
                self.apply(self.subscription.drain())  # what was queued before the close
                break
        if self._dirty:
            self.refresh()

    def flush(self, timeout: float = 3.0, quiet: float = 0.3) -> None:
        """Wait until no event has arrived for `quiet` s (or `timeout` s passed), then render.

        Call it after `engine.generate(...)` returns: the scheduler's last steps can
        reach the bus a moment after the result does."""
        if self.subscription is not None:
            end = time.monotonic() + timeout
            if self._thread is None:
                while time.monotonic() < end and self.pump(timeout=quiet):
                    pass
            else:
                # Quiet is measured from the call too: events already in flight count.
                began = self.clock()
                while time.monotonic() < end and self.clock() - max(self._last_event, began) < quiet:
                    time.sleep(0.05)
        elif self.replay is not None:
            self.apply(self.replay.drain())
        self.refresh(keyframe=True)

    def close(self) -> None:
        """Stop the pump thread and unsubscribe (views keep their last picture)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        if self.subscription is not None and hasattr(self.subscription, "close"):
            try:
                self.subscription.close()
            except Exception:  # closing twice, or a bus that is already gone
                pass

    # ---- replay ----------------------------------------------------------------------------

    def _use_replay(self, replay: Replay) -> None:
        self.replay = replay
        if replay.header is not None:
            self.state.apply(replay.header)
        rel, m = [], None
        for e in replay.events:
            m = e.ts if m is None or e.ts > m else m
            if type(e) is BatchStep:
                rel.append(m)
        self._step_release = rel  # replay-clock time at which step k is shown

    @property
    def num_steps(self) -> int:
        """Scheduler steps in the replay (0 for live sources)."""
        return len(self._step_release)

    def seek(self, ts_ns: int) -> None:
        """Move the replay to trace time ts_ns (backward rebuilds the state) and render."""
        if self.replay is None:
            raise RuntimeError("seek needs a recording or a list of events, not a live source")
        with self._lock:
            self.replay.seek(ts_ns)
            self.apply(self.replay.drain())
        self.refresh()

    def seek_step(self, k: int) -> None:
        """Show the replay just after its k-th scheduler step (0-based; -1: the end)."""
        if self.replay is None:
            raise RuntimeError("seek_step needs a recording or a list of events, not a live source")
        if not self._step_release or k < 0 or k >= len(self._step_release):
            self.seek(self.replay.end_ns)
        else:
            # Everything up to the next step's release, so each position includes the
            # tokenizer-side events (first token, finish) that belong to step k.
            nxt = self._step_release[k + 1] - 1 if k + 1 < len(self._step_release) else self.replay.end_ns
            self.seek(nxt)

    def step_at(self, ts_ns: int) -> int:
        """The index of the last step released by trace time ts_ns (-1 before the first)."""
        return bisect.bisect_right(self._step_release, ts_ns) - 1
