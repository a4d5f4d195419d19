"""The trace's clock: every timestamp a user sees (trace events, `meta_info` latencies, /metrics).

On a real engine it is the host's monotonic clock (`time.monotonic_ns`, comparable across the
processes of one host). A simulated deployment (`--simulate`, core/simulation/live.py) installs a
`SharedClock` in each of its processes instead: simulated time, kept in a small file in the
engine's private IPC directory. Its only writer of time is the scheduler, which holds the clock
still while it works, moves it by each pass's predicted duration, and lets it run (at `--sim-speed`
simulated seconds per wall second) only while it has nothing to do. So a deployment runs faster
than real time when asked and every stamp stays the deployment's, not this host's.

Two counters ride along so that no request is "in flight" while simulated time moves:
`note_sent` (the tokenizer manager, as a request arrives: it also stops the clock, so the request's
trip through this host's tokenizer manager and sockets takes no simulated time) and `announce` (a
driver that replays a workload: the arrival time of the next request it will send; running time
stops there). The scheduler does not start a step while a sent request has not reached it or an
announced arrival is due: what a request waits for is the deployment's work, never this host's.

Data parallel (`--dp-size N`): the replicas' passes overlap in simulated time, so each replica keeps
its own time in a slot of the file (`replica_begin`, `replica_advance`, `replica_end`; its process
stamps with `ReplicaClock`) and the shared time is the earliest of the busy replicas' times: every
event before it has happened. Only the replica furthest behind may start a pass (`replica_turn`), so
the host runs them one at a time in simulated-time order, as the offline Simulator steps them.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time

NEVER = 2**63 - 1  # "no arrival announced"
# PortArgs.extra key: the path of the engine's SharedClock file, for its children to `attach`.
SHARED_CLOCK_KEY = "shared_clock"
# Slots (int64 unless said): 0 seqlock counter, 1 simulated anchor (ns), 2 wall anchor (ns),
# 3 rate (float64: simulated s per wall s after the anchors; 0 = still), 4 the cap running time
# stops at (ns), 5 requests the tokenizer manager has sent, 6 the next announced arrival (ns), 7 the
# pid of the process that announced it (so a scheduler can tell a slow driver from a dead one).
_LAYOUT = struct.Struct("<qqqdqqqq")
_STATE = struct.Struct("<qqqdq")
_SENT, _ANNOUNCED, _ANNOUNCER = 40, 48, 56
# Data parallel, after the layout: the number of replica slots, the wall-pacing anchor (simulated ns,
# wall ns) and the deployment's peak KV use; then per replica: its time (ns), busy (0/1), requests it
# received, KV tokens it uses, token outputs it has sent, and whether a pass of its ended whose
# outputs are not sent yet (0/1).
_DP = struct.Struct("<qqqq")
_SLOT = struct.Struct("<qqqqqq")
_DP_AT = _LAYOUT.size
_SLOTS_AT = _DP_AT + _DP.size


class TraceClock:
    """The host's monotonic clock (a real engine's); the interface `SharedClock` fills in."""

    simulated = False
    # Whether this host's own delays (a message's trip through a socket, a process's Python) take
    # time on this clock. Where they do not, a token is out when the scheduler stamped it.
    counts_host_delays = True

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def note_sent(self) -> None:
        """A request arrived at the tokenizer manager, which will send it to the scheduler."""

    def note_unsent(self) -> None:
        """...but it failed before it was sent (a bad request)."""

    def announce(self, arrival_ns: int | None) -> None:
        """A driver's next request arrives at `arrival_ns` (None: none is coming)."""


class SharedClock(TraceClock):
    """Simulated time shared by an engine's processes through a small mapped file.

    The scheduler moves time (`hold`, `advance`, `run`, `jump_to`), the tokenizer manager stops it
    and counts its requests (`note_sent`), a driver announces arrivals. Writers of time take the
    file's lock; readers read under a sequence lock, so a reader never sees half a write. A fresh
    clock starts still at the host's monotonic time, so simulated stamps look like the usual ones."""

    simulated = True
    counts_host_delays = False

    def __init__(self, path: str, create: bool = False, replicas: int = 1):
        self.path = path
        if create:
            now = time.monotonic_ns()
            with open(path, "wb") as f:
                f.write(_LAYOUT.pack(0, now, now, 0.0, NEVER, 0, NEVER, 0))
                f.write(_DP.pack(replicas, now, now, 0))
                f.write(b"".join(_SLOT.pack(now, 0, 0, 0, 0, 0) for _ in range(replicas)))
        self._fd = os.open(path, os.O_RDWR)
        self._m = mmap.mmap(self._fd, os.fstat(self._fd).st_size)
        self.replicas = struct.unpack_from("<q", self._m, _DP_AT)[0]

    @contextlib.contextmanager
    def _locked(self):
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ---- reading ---------------------------------------------------------------
    def _state(self) -> tuple[int, int, float, int, int]:
        """(simulated anchor, wall anchor, rate, cap, the wall time it was read at): consistent, and
        the wall time read before the counter is checked again, so no write began before it."""
        while True:
            seq, sim, wall, rate, cap = _STATE.unpack_from(self._m, 0)
            read_at = time.monotonic_ns()
            if seq % 2 == 0 and struct.unpack_from("<q", self._m, 0)[0] == seq:
                return sim, wall, rate, cap, read_at
            time.sleep(0)  # a write is under way (a few microseconds)

    @staticmethod
    def _at(sim: int, wall: int, rate: float, cap: int, read_at: int) -> int:
        return sim if rate == 0.0 else min(cap, sim + int((read_at - wall) * rate))

    def _capped(self, sim: int, cap: int) -> int:
        """Running time stops at the cap or at an announced arrival still ahead, whichever is first:
        readers apply the announcement at once, before the scheduler next looks."""
        due = struct.unpack_from("<q", self._m, _ANNOUNCED)[0]
        return due if sim <= due < cap else cap

    def now_ns(self) -> int:
        sim, wall, rate, cap, read_at = self._state()
        return self._at(sim, wall, rate, self._capped(sim, cap) if rate else cap, read_at)

    @property
    def running(self) -> bool:
        """Whether time flows on its own now (the scheduler idles)."""
        return self._state()[2] != 0.0

    def sent(self) -> int:
        return struct.unpack_from("<q", self._m, _SENT)[0]

    def announced(self) -> int | None:
        v = struct.unpack_from("<q", self._m, _ANNOUNCED)[0]
        return None if v == NEVER else v

    def announcer(self) -> int:
        """The pid of the process that made the last announcement (0: none yet)."""
        return struct.unpack_from("<q", self._m, _ANNOUNCER)[0]

    # ---- the scheduler ---------------------------------------------------------
    def _write(self, sim: int, rate: float, cap: int = NEVER) -> None:
        """Publish a new state (under the file lock). `_hold` turns the counter odd before it reads
        the time it publishes, so no reader sees a later time than the one held."""
        seq = struct.unpack_from("<q", self._m, 0)[0]
        if seq % 2 == 0:
            seq += 1
            struct.pack_into("<q", self._m, 0, seq)  # odd: readers wait
        _STATE.pack_into(self._m, 0, seq, sim, time.monotonic_ns(), rate, cap)
        struct.pack_into("<q", self._m, 0, seq + 1)

    def _hold(self) -> int:
        state = self._state()
        if state[2] == 0.0:
            return state[0]
        seq = struct.unpack_from("<q", self._m, 0)[0]
        struct.pack_into("<q", self._m, 0, seq + 1)  # odd from here: the time read below is the latest
        sim, wall, rate, cap = state[:4]
        now = self._at(sim, wall, rate, self._capped(sim, cap), time.monotonic_ns())
        self._write(now, 0.0)
        return now

    def hold(self) -> int:
        """Stop time where it is (the scheduler has work); returns the simulated now."""
        with self._locked():
            return self._hold()

    def advance(self, ns: int) -> int:
        """Held time moves on by `ns` (a pass's predicted duration); returns the new now."""
        with self._locked():
            now = self._hold() + max(0, int(ns))
            self._write(now, 0.0)
            return now

    def jump_to(self, ns: int) -> None:
        """Held at `ns` if that is later (an idle gap skipped; not while a replica is busy)."""
        with self._locked():
            if ns > self._hold() and not self._busy_times():
                self._write(ns, 0.0)

    def run(self, rate: float, until: int | None = None, received: int | None = None) -> None:
        """Let time flow at `rate` simulated seconds per wall second from now (the scheduler idles),
        stopping at `until` if given (an announced arrival: time waits there for the request); not
        if more than `received` requests were sent (one arrived since the caller looked)."""
        cap = NEVER if until is None else int(until)
        _, _, current, current_cap, _ = self._state()
        if current != rate or current_cap != cap:
            with self._locked():
                if (received is None or self.sent() <= received) and not self._busy_times():
                    self._write(self._hold(), rate, cap)

    # ---- data-parallel replicas (each in its own scheduler process) -------------
    def _slot(self, rank: int) -> tuple[int, ...]:
        return _SLOT.unpack_from(self._m, _SLOTS_AT + rank * _SLOT.size)

    def _set_slot(self, rank: int, local: int, busy: int) -> None:
        struct.pack_into("<qq", self._m, _SLOTS_AT + rank * _SLOT.size, local, busy)

    def _busy_times(self) -> list[tuple[int, int]]:
        """(time, rank) of every busy replica."""
        out = []
        for r in range(self.replicas):
            local, busy = self._slot(r)[:2]
            if busy:
                out.append((local, r))
        return out

    def _settle(self) -> None:
        """Shared time becomes the earliest busy replica's (it never goes back: a replica that began
        at an arrival before it is behind it for a while; none busy: it stays)."""
        busy = self._busy_times()
        now = self._hold()
        if busy and min(busy)[0] > now:
            self._write(min(busy)[0], 0.0)

    def replica_begin(self, rank: int, at: int) -> int:
        """Replica `rank` has work from simulated time `at` (its request's arrival): it goes on from
        there, or from its own time if that is later (its last pass ended after it). Time is held; the
        first busy replica anchors the wall pacing. Returns the replica's time."""
        with self._locked():
            local = self._slot(rank)[0]
            now = self._hold()
            if not self._busy_times():
                struct.pack_into("<qq", self._m, _DP_AT + 8, now, time.monotonic_ns())
            local = max(local, at)
            self._set_slot(rank, local, 1)
            return local

    def replica_advance(self, rank: int, ns: int) -> int:
        """Replica `rank`'s pass of `ns` ended: its time moves on (its outputs are pending until
        `outputs_sent`); returns it."""
        with self._locked():
            local = self._slot(rank)[0] + max(0, int(ns))
            # Pending before the time: a `replica_turn` (not locked) that sees the new time sees it too.
            struct.pack_into("<q", self._m, _SLOTS_AT + rank * _SLOT.size + 40, 1)
            self._set_slot(rank, local, 1)
            self._settle()
            return local

    def outputs_sent(self, rank: int, n: int) -> None:
        """Replica `rank` has sent `n` token outputs in all, those of its last pass included."""
        at = _SLOTS_AT + rank * _SLOT.size
        struct.pack_into("<q", self._m, at + 32, n)
        struct.pack_into("<q", self._m, at + 40, 0)  # after the count: a reader that sees 0 sees the count

    def outputs_of(self, rank: int) -> int | None:
        """Token outputs replica `rank` has sent, or None while a pass of its has ended and its
        outputs are still being sent (the data-parallel controller waits for them before it routes:
        its load counts are then those the offline Simulator's balancer has)."""
        sent, pending = self._slot(rank)[4:]
        return None if pending else sent

    def replica_end(self, rank: int) -> None:
        """Replica `rank` has nothing to do: the shared time may move on to the next busy replica's."""
        with self._locked():
            local, busy = self._slot(rank)[:2]
            if busy:
                self._set_slot(rank, local, 0)
                self._settle()

    def replica_turn(self, rank: int) -> bool:
        """Whether replica `rank` is the busy one furthest behind (ties: the lowest rank), the one
        that may start a pass, and no other replica's pass has ended without its step being done (its
        outputs sent, its KV noted): the offline Simulator finishes a replica's step before it picks
        the next, so the deployment's KV peak sums the same states (a replica that went on while the
        one before still noted its KV summed that one's old use: 32,790 tokens against 32,813)."""
        # One read of each slot, its time and flag together: a replica whose pass ends between a read of
        # the flags and a read of the times would look done and ahead at once.
        slots = [self._slot(r) for r in range(self.replicas)]
        if any(s[5] for r, s in enumerate(slots) if r != rank):
            return False
        busy = [(s[0], r) for r, s in enumerate(slots) if s[1]]
        return bool(busy) and min(busy)[1] == rank

    def replica_now(self, rank: int) -> int:
        """Replica `rank`'s time while it is busy, else the shared time."""
        local, busy = self._slot(rank)[:2]
        return local if busy else self.now_ns()

    def set_received(self, rank: int, n: int) -> None:
        """Replica `rank` has received `n` generate requests (after `replica_begin`, so a replica that
        sees every sent request received also sees the new one's replica busy)."""
        struct.pack_into("<q", self._m, _SLOTS_AT + rank * _SLOT.size + 16, n)

    def received_total(self) -> int:
        return sum(self._slot(r)[2] for r in range(self.replicas))

    def all_idle(self) -> bool:
        return not self._busy_times()

    def pace_deadline(self, sim_ns: int, speed: float) -> float:
        """The wall time (monotonic s) a pass ending at `sim_ns` is due at `speed`."""
        sim, wall = struct.unpack_from("<qq", self._m, _DP_AT + 8)
        return (wall + (sim_ns - sim) / speed) / 1e9

    def repace(self, sim_ns: int, wall_s: float) -> None:
        """Re-anchor the pacing: simulated `sim_ns` is wall time `wall_s` (the host fell behind)."""
        struct.pack_into("<qq", self._m, _DP_AT + 8, sim_ns, int(wall_s * 1e9))

    def note_kv(self, rank: int, used: int) -> int:
        """Replica `rank` uses `used` KV tokens now; returns the deployment's peak (all replicas' sum)."""
        with self._locked():
            struct.pack_into("<q", self._m, _SLOTS_AT + rank * _SLOT.size + 24, used)
            total = sum(self._slot(r)[3] for r in range(self.replicas))
            peak = max(total, struct.unpack_from("<q", self._m, _DP_AT + 24)[0])
            struct.pack_into("<q", self._m, _DP_AT + 24, peak)
            return peak

    # ---- the tokenizer manager and a driver ------------------------------------
    def note_sent(self) -> None:
        with self._locked():
            self._hold()
            struct.pack_into("<q", self._m, _SENT, self.sent() + 1)

    def note_unsent(self) -> None:
        with self._locked():
            struct.pack_into("<q", self._m, _SENT, self.sent() - 1)

    def announce(self, arrival_ns: int | None) -> None:
        # Never behind now: readers stop running time at an announcement, and time never goes back.
        due = NEVER if arrival_ns is None else max(int(arrival_ns), self.now_ns())
        struct.pack_into("<q", self._m, _ANNOUNCER, os.getpid())
        struct.pack_into("<q", self._m, _ANNOUNCED, due)

    def close(self) -> None:
        if self._fd >= 0:
            self._m.close()
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass  # interpreter shutdown


class ReplicaClock(TraceClock):
    """A data-parallel replica's process clock: its own time while it is busy, else the shared time."""

    simulated = True
    counts_host_delays = False

    def __init__(self, shared: SharedClock, rank: int):
        self.shared, self.rank = shared, rank

    def now_ns(self) -> int:
        return self.shared.replica_now(self.rank)


_clock: TraceClock = TraceClock()


def now_ns() -> int:
    """The trace clock's now: the host's monotonic ns, or a simulated deployment's."""
    return _clock.now_ns()


def current() -> TraceClock:
    """This process's clock (a `SharedClock` in a simulated deployment's processes)."""
    return _clock


def install(clock: TraceClock | None) -> TraceClock:
    """Make `clock` this process's trace clock (None: the host's again); returns the one before."""
    global _clock
    before, _clock = _clock, clock if clock is not None else TraceClock()
    return before


def attach(path: str | None) -> None:
    """In an engine's child process: use the shared clock at `path` if the engine made one."""
    if path:
        install(SharedClock(path))
