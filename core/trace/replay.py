"""Replay: play a recording (or a list of events) through a Subscription-like source.

The consumer owns the clock, so replay is deterministic when it wants it to be:

    r = Replay("run.jsonl")
    state = TraceState()
    while not r.done:
        r.step()                      # everything up to and including the next batch.step
        state.apply_many(r.drain())

`advance_to(ts_ns)` releases every event due by a trace timestamp (frozen
clocks, tests); `play()/pause()/set_speed()` with `advance(now_ns)` (or just
`drain()`/`get()` while playing) follow the wall clock at `speed`x; `seek(ts)`
jumps, and a backward seek emits `trace.reset` followed by every event up to
`ts`, so a consumer that folds what it drains into a TraceState ends up with
exactly the state at `ts` without special handling.

Events keep the recorded (delivery) order; an event is due at the running
maximum of the timestamps so far, which keeps the replay clock monotone when
processes' events interleave slightly out of order.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from workbench.core.trace import events as ev
from workbench.core.trace.events import BatchStep, Event, TraceHeader, TraceReset
from workbench.core.trace.recorder import read_trace
from workbench.core.trace.state import TraceState

# What counts as the run having begun: a request event or a scheduler step. Engine start-up
# (proc.started, the empty tree and queues, model loading) comes before and is not part of it.
_ACTIVITY = (
    ev.ReqArrived,
    ev.ReqTokenized,
    ev.ReqQueued,
    ev.ReqScheduled,
    ev.ReqDispatched,
    ev.ReqFirstToken,
    ev.ReqFinished,
    ev.ReqAborted,
    ev.ReqRetracted,
    ev.ReqText,
    ev.ReqSnapshot,
    ev.BatchStep,
)


class Replay:
    """A replayable event source with `get/drain` like a bus Subscription.

    Args:
        source: a recording's path, or events. The trace.header (`.header`, not in
            `.events`) is played first, as on a remote stream, and again after a reset.
        speed: playback rate for `play()` (2.0 = twice as fast).
        max_idle_s: while playing, a gap longer than this (trace time) with nothing
            to show is skipped; None keeps real gaps.
        clock: the wall clock in ns that play/pause/advance follow (a fake one in tests).
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Iterable[Event],
        speed: float = 1.0,
        max_idle_s: float | None = 2.0,
        clock: Callable[[], int] = time.monotonic_ns,
    ):
        self.header: TraceHeader | None = None
        if isinstance(source, (str, os.PathLike)):
            self.header, events = read_trace(source)
        else:
            events = list(source)
            if events and isinstance(events[0], TraceHeader):
                self.header, events = events[0], events[1:]
        self.events: list[Event] = events  # without the header
        self._header_pending = self.header is not None
        # A header is stamped when recording starts, which need not relate to the events'
        # clock: it is due with the event after it and never moves the replay clock.
        latest: list[int | None] = []  # the latest ts so far; None for a header
        m = None
        for e in events:
            if type(e) is TraceHeader:
                latest.append(None)
                continue
            m = e.ts if m is None or e.ts > m else m
            latest.append(m)
        release = [0] * len(latest)
        nxt = m if m is not None else 0
        for i in range(len(latest) - 1, -1, -1):
            t = latest[i]
            if t is None:
                release[i] = nxt
            else:
                release[i] = nxt = t
        self._release = release
        self._step_idx = [i for i, e in enumerate(events) if type(e) is BatchStep]
        self.start_ns = release[0] if release else 0
        self.end_ns = release[-1] if release else 0
        self.duration_ns = self.end_ns - self.start_ns
        # The replay clock's zero: when the first request/step event is due (start_ns if there is
        # none). A recording may begin with the engine's start-up, which a learner should not
        # have to sit through or count (ReplayController starts the clock here).
        self.origin_ns = next((release[i] for i, e in enumerate(events) if isinstance(e, _ACTIVITY)), self.start_ns)
        self.position_ns = self.start_ns  # trace time the replay clock shows
        self.speed = float(speed)
        self.max_idle_ns = None if max_idle_s is None else int(max_idle_s * 1e9)
        self.playing = False
        self._clock = clock
        self.epoch = 0  # bumps on every backward seek
        self._pos = 0  # next event to release
        self._q: deque[Event] = deque()
        self._wall_ref = 0

    # ---- state ------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Every event has been released and consumed."""
        return self._pos >= len(self.events) and not self._q

    @property
    def released(self) -> int:
        """How many of `events` have been released."""
        return self._pos

    @property
    def release_ns(self) -> list[int]:
        """When each of `events` is due on the replay clock (non-decreasing)."""
        return self._release

    def step_release_ns(self) -> list[int]:
        """When each batch.step is due, in order (e.g. for a step slider)."""
        return [self._release[i] for i in self._step_idx]

    @property
    def progress(self) -> float:
        return 1.0 if not self.duration_ns else (self.position_ns - self.start_ns) / self.duration_ns

    # ---- deterministic clock ----------------------------------------------------

    def _release_to(self, j: int) -> list[Event]:
        out = self.events[self._pos : j]
        if self._header_pending and out and self.header is not None:
            # Like a remote stream, playback starts with the header (model, schema).
            self._header_pending = False
            out.insert(0, self.header)
        self._q.extend(out)
        self._pos = max(self._pos, j)
        return out

    def advance_to(self, ts_ns: int) -> list[Event]:
        """Release every event due at or before trace time ts_ns (forward only); returns them."""
        if ts_ns <= self.position_ns and (self._pos >= len(self.events) or self._release[self._pos] > ts_ns):
            return []
        j = bisect.bisect_right(self._release, ts_ns, lo=self._pos)
        self.position_ns = max(self.position_ns, ts_ns)
        return self._release_to(j)

    def step(self) -> list[Event]:
        """Release everything up to and including the next batch.step (or to the end)."""
        if self._pos >= len(self.events):
            return []
        k = bisect.bisect_left(self._step_idx, self._pos)
        last = self._step_idx[k] if k < len(self._step_idx) else len(self.events) - 1
        self.position_ns = max(self.position_ns, self._release[last])
        return self._release_to(last + 1)

    def seek(self, ts_ns: int) -> None:
        """Move the clock to ts_ns. Backward: queue trace.reset + the events up to ts_ns."""
        self._wall_ref = self._clock()
        if ts_ns >= self.position_ns:
            self.advance_to(ts_ns)
            return
        self._q.clear()
        self._q.append(TraceReset(ts=ts_ns, proc="replay"))
        self._header_pending = self.header is not None
        self._pos = 0
        self.position_ns = ts_ns
        self.epoch += 1
        self._release_to(bisect.bisect_right(self._release, ts_ns))

    def state_at(self, ts_ns: int) -> TraceState:
        """A fresh TraceState folded from the events due by ts_ns (leaves the replay alone)."""
        st = TraceState()
        if self.header is not None:
            st.apply(self.header)
        st.apply_many(self.events[: bisect.bisect_right(self._release, ts_ns)])
        return st

    # ---- wall clock ---------------------------------------------------------------

    def play(self) -> None:
        """Start following the clock."""
        if not self.playing:
            self.playing = True
            self._wall_ref = self._clock()

    def pause(self) -> None:
        self.advance()
        self.playing = False

    def set_speed(self, speed: float) -> None:
        self.advance()  # bank the time played at the old speed
        self.speed = float(speed)

    def advance(self, now_ns: int | None = None) -> list[Event]:
        """While playing, move the clock by (now - last call) * speed and release what is due."""
        if not self.playing:
            return []
        now = self._clock() if now_ns is None else now_ns
        target = self.position_ns + int(max(0, now - self._wall_ref) * self.speed)
        self._wall_ref = now
        if (
            self.max_idle_ns is not None
            and not self._q
            and self._pos < len(self.events)
            and self._release[self._pos] - target > self.max_idle_ns
        ):
            target = self._release[self._pos]
        return self.advance_to(target)

    # ---- Subscription-like interface ------------------------------------------------

    def get(self, timeout: float | None = None) -> Event | None:
        """The next released event. Paused: never waits. Playing: waits up to
        `timeout` s (None: until one is due or the replay ends), sleeping in real
        time, so with a fake clock pass a timeout or use drain()."""
        if not self._q and self.playing:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._q and self._pos < len(self.events):
                self.advance()
                if self._q:
                    break
                wait = (self._release[self._pos] - self.position_ns) / 1e9 / max(self.speed, 1e-9)
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wait = min(wait, left)
                time.sleep(min(max(wait, 0.0), 0.05))
        return self._q.popleft() if self._q else None

    def drain(self, max_items: int | None = None) -> list[Event]:
        """Released events not consumed yet (advancing the clock first while playing)."""
        self.advance()
        n = len(self._q) if max_items is None else min(max_items, len(self._q))
        return [self._q.popleft() for _ in range(n)]

    def run_realtime(
        self, callback: Callable[[list[Event]], None], tick_s: float = 0.05, stop: threading.Event | None = None
    ) -> None:
        """Play at `speed`, calling callback(batch) every tick until done or `stop` is set.
        Blocks; run it in a thread to keep a UI responsive."""
        self.play()
        while not self.done and not (stop is not None and stop.is_set()):
            batch = self.drain()
            if batch:
                callback(batch)
            elif not self.done:
                time.sleep(tick_s)
