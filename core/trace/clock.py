"""The trace's clock: every timestamp a user sees (trace events, `meta_info` latencies, /metrics).

On a real engine it is the host's monotonic clock (`time.monotonic_ns`, comparable across the
processes of one host). A simulated deployment (`--simulate`, core/simulation/live.py) installs a
`SharedClock` in each of its processes instead: simulated time, kept in a small file in the
engine's private IPC directory. Its only writer of time is the scheduler, which holds the clock
still while it works, moves it by each pass's predicted duration, and lets it run (at `--sim-speed`
simulated seconds per wall second) only while it has nothing to do. So a deployment runs faster
than real time when asked and every stamp stays the deployment's, not this host's.

Two counters ride along so that no request is "in flight" while simulated time moves:
`note_sent` (the tokenizer manager, before it sends a request to the scheduler) and `announce`
(a driver that replays a workload: the arrival time of the next request it will send). The
scheduler does not start a step while a sent request has not reached it or an announced arrival
is due: what a request waits for is the deployment's work, never this host's.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from typing import Optional

NEVER = 2**63 - 1  # "no arrival announced"
# Slots (int64 unless said): 0 seqlock counter, 1 simulated anchor (ns), 2 wall anchor (ns),
# 3 rate (float64: simulated s per wall s after the anchors; 0 = still), 4 the cap running time
# stops at (ns), 5 requests the tokenizer manager has sent, 6 the next announced arrival (ns).
_LAYOUT = struct.Struct("<qqqdqqq")
_STATE = struct.Struct("<qqqdq")
_SENT, _ANNOUNCED = 40, 48


class TraceClock:
    """The host's monotonic clock (a real engine's); the interface `SharedClock` fills in."""

    simulated = False

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def note_sent(self) -> None:
        """The tokenizer manager is about to send a request to the scheduler."""

    def announce(self, arrival_ns: Optional[int]) -> None:
        """A driver's next request arrives at `arrival_ns` (None: none is coming)."""


class SharedClock(TraceClock):
    """Simulated time shared by an engine's processes through a 56-byte mapped file.

    Only the scheduler writes time (`hold`, `advance`, `run`, `jump_to`), only the tokenizer
    manager writes its sent count and only a driver announces; time is read under a sequence lock,
    so a reader never sees half a write. A fresh clock starts still at the host's monotonic time,
    so simulated stamps look like the trace's usual ones."""

    simulated = True

    def __init__(self, path: str, create: bool = False):
        self.path = path
        if create:
            with open(path, "wb") as f:
                f.write(_LAYOUT.pack(0, time.monotonic_ns(), time.monotonic_ns(), 0.0, NEVER, 0, NEVER))
        fd = os.open(path, os.O_RDWR)
        try:
            self._m = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)
        self._seq = 0  # the writer's own copy (one writer of time per clock)

    # ---- reading ---------------------------------------------------------------
    def _state(self) -> tuple[int, int, float, int]:
        while True:
            seq, sim, wall, rate, cap = _STATE.unpack_from(self._m, 0)
            if seq % 2 == 0 and struct.unpack_from("<q", self._m, 0)[0] == seq:
                return sim, wall, rate, cap
            time.sleep(0)  # a write is under way (a few microseconds)

    @staticmethod
    def _at(sim: int, wall: int, rate: float, cap: int) -> int:
        return sim if rate == 0.0 else min(cap, sim + int((time.monotonic_ns() - wall) * rate))

    def now_ns(self) -> int:
        return self._at(*self._state())

    @property
    def running(self) -> bool:
        """Whether time flows on its own now (the scheduler idles)."""
        return self._state()[2] != 0.0

    def sent(self) -> int:
        return struct.unpack_from("<q", self._m, _SENT)[0]

    def announced(self) -> Optional[int]:
        v = struct.unpack_from("<q", self._m, _ANNOUNCED)[0]
        return None if v == NEVER else v

    # ---- the scheduler ---------------------------------------------------------
    def _write(self, sim: int, rate: float, cap: int = NEVER) -> None:
        seq = struct.unpack_from("<q", self._m, 0)[0]
        struct.pack_into("<q", self._m, 0, seq + 1)  # odd: readers wait
        _STATE.pack_into(self._m, 0, seq + 1, sim, time.monotonic_ns(), rate, cap)
        struct.pack_into("<q", self._m, 0, seq + 2)

    def hold(self) -> int:
        """Stop time where it is (the scheduler has work); returns the simulated now."""
        state = self._state()
        if state[2] == 0.0:
            return state[0]
        now = self._at(*state)
        self._write(now, 0.0)
        return now

    def advance(self, ns: int) -> int:
        """Held time moves on by `ns` (a pass's predicted duration); returns the new now."""
        now = self.hold() + max(0, int(ns))
        self._write(now, 0.0)
        return now

    def jump_to(self, ns: int) -> None:
        """Held at `ns` if that is later (an idle gap skipped)."""
        now = self.hold()
        if ns > now:
            self._write(ns, 0.0)

    def run(self, rate: float, until: Optional[int] = None) -> None:
        """Let time flow at `rate` simulated seconds per wall second from now (the scheduler idles),
        stopping at `until` if given (an announced arrival: time waits there for the request)."""
        cap = NEVER if until is None else int(until)
        _, _, current, current_cap = self._state()
        if current != rate or current_cap != cap:
            self._write(self.hold(), rate, cap)

    # ---- the tokenizer manager and a driver ------------------------------------
    def note_sent(self) -> None:
        struct.pack_into("<q", self._m, _SENT, self.sent() + 1)

    def announce(self, arrival_ns: Optional[int]) -> None:
        struct.pack_into("<q", self._m, _ANNOUNCED, NEVER if arrival_ns is None else int(arrival_ns))

    def close(self) -> None:
        self._m.close()


_clock: TraceClock = TraceClock()


def now_ns() -> int:
    """The trace clock's now: the host's monotonic ns, or a simulated deployment's."""
    return _clock.now_ns()


def current() -> TraceClock:
    """This process's clock (a `SharedClock` in a simulated deployment's processes)."""
    return _clock


def install(clock: Optional[TraceClock]) -> TraceClock:
    """Make `clock` this process's trace clock (None: the host's again); returns the one before."""
    global _clock
    before, _clock = _clock, clock if clock is not None else TraceClock()
    return before


def attach(path: Optional[str]) -> None:
    """In an engine's child process: use the shared clock at `path` if the engine made one."""
    if path:
        install(SharedClock(path))
