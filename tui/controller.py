"""Controllers: the app's one handle on where events come from and what it may ask for.

The app never touches an engine directly. It asks its controller to start
(with progress), to drain events, for the current time, to pause / step /
resume, to send a chat prompt and to run a workload. Three kinds:

- `EngineController`: a live `Engine` (made here, or handed in by a test);
- `ReplayController`: a `Replay` of a recording (play / pause / step through it);
- `AttachController`: a remote `--trace-publish` stream (watch only).

Every method that may block (start, step, chat, close) is called from a
thread worker, never from the UI thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from workbench.core.trace import events as _ev
from workbench.core.trace.events import Event

#: Where start() reports: progress lines (str) and, from a live engine, its start-up phases
#: (`engine.phase` events, which the start-up screen folds into a StartupProgress).
Progress = Callable[[Any], None]

# Request ids must stay unique for the life of an engine (TraceState keys requests by rid, and a
# finished rid is final), so chat and workload numbering is process-wide, not per controller/run.
_CHAT_IDS = itertools.count(1)
_WORKLOAD_IDS = itertools.count(1)


class ControlUnavailable(RuntimeError):
    """The action makes no sense for this source (e.g. chat while replaying)."""


class Controller:
    """Base class: a source with no controls. Subclasses override what they support."""

    mode = "none"
    can_chat = False
    can_step = False
    can_workload = False
    #: control calls may block (an engine RPC): the app runs them on its control thread
    threaded = False

    def __init__(self) -> None:
        self.paused = False
        self.workload: str | None = None
        self.rate = 1.0
        self.title = ""
        #: trace time shown as 0 (the events log's times); None: the first event's
        self.origin_ns: int | None = None
        #: a line the app shows once started (why a default workload runs)
        self.start_note = ""

    # ---- lifecycle ------------------------------------------------------------
    def start(self, progress: Progress) -> None:
        """Get ready (load a model, open a file, connect). Blocking; raise with a clear message."""

    def close(self) -> None:
        """Release everything (idempotent): stop workloads, shut down an owned engine."""

    # ---- events and time ------------------------------------------------------
    def drain(self, max_items: int | None = None) -> list[Event]:
        return []

    def now_ns(self) -> int:
        engine = getattr(self, "engine", None)  # a live engine's clock: simulated time for a simulated one
        return engine.clock.now_ns() if getattr(engine, "clock", None) is not None else time.monotonic_ns()

    def status(self) -> str:
        return self.mode

    # ---- scheduler control ----------------------------------------------------
    def set_paused(self, paused: bool) -> bool:
        raise ControlUnavailable(f"pausing is not available in {self.mode} mode")

    def step(self) -> int:
        """Run exactly one scheduler iteration (or release one replayed step); returns its step id."""
        raise ControlUnavailable(f"stepping is not available in {self.mode} mode")

    # ---- chat and workloads ---------------------------------------------------
    def chat(
        self,
        prompt: str,
        on_delta: Callable[[str, str], None],
        cancelled: Callable[[], bool],
        max_new_tokens: int = 128,
    ) -> dict:
        raise ControlUnavailable(f"chat needs a live engine (this is {self.mode} mode)")

    def start_workload(self, kind: str | None = None, rate: float | None = None, **options) -> None:
        raise ControlUnavailable(f"workloads need a live engine (this is {self.mode} mode)")

    def stop_workload(self) -> None:
        pass

    def set_rate(self, rate: float) -> None:
        self.rate = max(0.05, float(rate))


class EngineController(Controller):
    """A live engine. Pass `engine=` to use one you own (it is then not shut down here),
    or `server_args=` (a ServerArgs or kwargs dict) to have `start()` create one."""

    mode = "live"
    can_chat = True
    can_step = True
    can_workload = True
    threaded = True

    def __init__(
        self,
        engine: Any = None,
        *,
        server_args: Any = None,
        workload: str | None = None,
        rate: float | None = None,
        max_new_tokens: int = 32,
        start_paused: bool = False,
        scenario: Any = None,
    ):
        """`scenario`: a workbench.scenarios.Scenario started once the engine is up (its engine
        settings are the caller's business: `scenario.server_args(...)`); `workload`: a workload
        kind started at `rate` instead."""
        super().__init__()
        self.engine = engine
        self._own = engine is None
        self._server_args = server_args
        self.scenario = scenario
        self._initial_workload = workload or (scenario.name if scenario is not None else None)
        self.workload = self._initial_workload
        self.rate = rate or (scenario.initial_rate if scenario is not None else 1.0)
        self.max_new_tokens = max_new_tokens
        self._start_paused = start_paused
        self._sub = None
        self._runner = None
        self._chat_rids: set[str] = set()
        self._closed = False
        self._lock = threading.Lock()
        #: the engine's log file (the TUI's, where the children's output goes); None: the engine picks one
        self.log_path: str | None = None

    def start(self, progress: Progress) -> None:
        if self.engine is None:
            from workbench.core.args import ServerArgs
            from workbench.core.engine import Engine

            sa = self._server_args
            if isinstance(sa, dict) or sa is None:
                sa = ServerArgs(**(sa or {}))
            progress(f"starting engine: model {sa.model_path or 'default (SmolLM2-135M-Instruct)'}")
            _ensure_resource_tracker()
            engine = Engine(server_args=sa, on_progress=progress, on_phase=progress, log_path=self.log_path)
            with self._lock:
                if self._closed:  # q was pressed while the model loaded
                    engine.shutdown()
                    raise ControlUnavailable("closed during start-up")
                self.engine = engine
        # a simulated deployment's label carries its badge ("SIMULATED h100x8 llama-3.1-70b")
        self.title = str(getattr(self.engine, "trace_label", "") or getattr(self.engine, "served_model_name", "") or "")
        progress("engine ready; subscribing to the trace bus")
        self._sub = self.engine.subscribe(with_snapshot=True, name="tui")
        if self._start_paused:
            self.set_paused(True)
        if self._initial_workload:
            # --paused: the workload waits with the scheduler (p starts both)
            self.start_workload(rate=self.rate, paused=self._start_paused)

    def drain(self, max_items: int | None = None) -> list[Event]:
        return self._sub.drain(max_items) if self._sub is not None else []

    def status(self) -> str:
        runner = self._runner
        if runner is None:
            return f"LIVE {self.title}"
        from workbench.scenarios import runner_status

        what = "scenario" if runner.adaptive else "workload"
        return f"LIVE {self.title} · {what} {runner_status(runner)}"

    def set_paused(self, paused: bool) -> bool:
        """Pause or resume the scheduler, and the workload's arrivals with it (so a single step
        admits only what was already queued)."""
        self.paused = bool(self.engine.step_gate("pause" if paused else "resume")["paused"])
        runner = self._runner
        if runner is not None:
            if self.paused:
                runner.pause()
            else:
                runner.resume()
        return self.paused

    def step(self) -> int:
        return int(self.engine.step_gate("step", 1)["step"])

    def chat(
        self,
        prompt: str,
        on_delta: Callable[[str, str], None],
        cancelled: Callable[[], bool],
        max_new_tokens: int = 128,
    ) -> dict:
        rid = f"chat-{next(_CHAT_IDS)}"
        from workbench.tui.workload import chat_text

        text = chat_text(self.engine, [{"role": "user", "content": prompt}])
        self._chat_rids.add(rid)
        last: dict = {}
        try:
            for chunk in self.engine.generate(
                prompt=text,
                stream=True,
                rid=rid,
                sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0.0},
            ):
                if cancelled():
                    self.engine.abort_request(rid)
                    break
                last = chunk
                on_delta(rid, chunk.get("delta", ""))
        finally:
            self._chat_rids.discard(rid)
        return last

    def start_workload(self, kind: str | None = None, rate: float | None = None, **options) -> None:
        """Start (or restart) a workload: `kind` (a workload kind, run at a fixed rate), or with no
        kind the scenario (adaptive) or the last kind. `options` go to WorkloadRunner
        (max_requests, temperature, paused...)."""
        from workbench.tui.workload import WorkloadRunner

        self.stop_workload()
        if kind is not None and (self.scenario is None or kind != self.scenario.name):
            self.scenario = None  # W picked a plain workload kind
        self.workload = kind or self.workload or "chat"
        if rate is not None:
            self.rate = max(0.05, float(rate))
        # A restarted workload must not reuse rids ("sp-1" again): all share one counter.
        options.setdefault("ids", _WORKLOAD_IDS)
        if self.scenario is not None:
            self._runner = self.scenario.runner(self.engine, rate=self.rate, **options)
        else:
            options.setdefault("max_new_tokens", self.max_new_tokens)
            self._runner = WorkloadRunner(self.engine, self.workload, self.rate, **options)
        self._runner.start()

    def stop_workload(self) -> int:
        """Stop the workload; its requests still in flight are aborted (returns how many)."""
        runner, self._runner = self._runner, None
        if runner is None:
            return 0
        self.rate = runner.rate  # a restart continues from where the adaptive rate got to
        return runner.stop()

    def change_load(self, factor: float) -> str:
        """`+` / `-`: a fixed-rate workload's rate, or an adaptive one's target in flight, × factor;
        returns what it is now, for a note."""
        from workbench.workloads import fmt_rate

        runner = self._runner
        if runner is not None and runner.adaptive:
            runner.set_target(runner.target_in_flight * factor)
            return f"scenario keeps ~{runner.target_in_flight:.0f} requests in flight"
        self.set_rate(self.rate * factor)
        return f"workload rate {fmt_rate(self.rate)} req/s"

    @property
    def workload_running(self) -> bool:
        return self._runner is not None

    @property
    def runner(self):
        return self._runner

    def set_rate(self, rate: float) -> None:
        super().set_rate(rate)
        if self._runner is not None:
            self._runner.set_rate(self.rate)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.stop_workload()
        eng = self.engine
        if eng is not None:
            for rid in list(self._chat_rids):
                _quietly(eng.abort_request, rid)
            if self.paused:
                # A paused scheduler would hold back the aborts and any in-flight step.
                _quietly(eng.step_gate, "resume")
                self.paused = False
        if self._sub is not None:
            _quietly(self._sub.close)
        if eng is not None and self._own:
            _quietly(eng.shutdown)


class ReplayController(Controller):
    """Plays a `Replay`; pausing and stepping act on the replay clock, not on an engine."""

    mode = "replay"
    can_step = True

    def __init__(self, replay: Any, *, autoplay: bool = True, speed: float | None = None, title: str = ""):
        super().__init__()
        self.replay = replay
        if speed is not None:
            replay.set_speed(speed)
        self._autoplay = autoplay
        self.paused = not autoplay
        recorded = replay.header.model if getattr(replay, "header", None) else ""
        self.title = title or recorded
        if recorded.startswith("SIMULATED") and recorded not in self.title:
            self.title = f"{recorded} · {self.title}"  # a simulated run says so in every view's status line
        # The clock starts at the first request/step event, not at the engine's start-up.
        self.origin_ns = replay.origin_ns

    @classmethod
    def from_file(cls, path: str, **kw) -> ReplayController:
        from workbench.core.trace.replay import Replay

        return cls(Replay(path), title=kw.pop("title", str(path)), **kw)

    def _before_first_request(self) -> int:
        """Trace time just before the first request/step event: start-up is behind it."""
        r = self.replay
        return r.origin_ns - 1 if r.origin_ns > r.start_ns else r.start_ns

    def start(self, progress: Progress) -> None:
        progress(f"replaying {len(self.replay.events)} events")
        if self.replay.origin_ns > self.replay.start_ns:
            # show the engine as it was once started (processes, empty tree) at once, so playing
            # (or the first step) starts with the first request
            self.replay.advance_to(self._before_first_request())
        if self._autoplay:
            self.replay.play()

    def drain(self, max_items: int | None = None) -> list[Event]:
        return self.replay.drain(max_items)

    def now_ns(self) -> int:
        return self.replay.position_ns  # trace time: deterministic, frozen while paused

    def status(self) -> str:
        r = self.replay
        pos = max(0, min(r.position_ns, r.end_ns) - r.origin_ns) / 1e9
        state = "end" if r.released >= len(r.events) else ("paused" if not r.playing else "playing")
        return f"REPLAY {self.title} · {pos:.2f}/{(r.end_ns - r.origin_ns) / 1e9:.2f} s · ×{r.speed:g} · {state}"

    def set_paused(self, paused: bool) -> bool:
        if paused:
            self.replay.pause()
        else:
            self.replay.play()
        self.paused = paused
        return paused

    def step(self) -> int:
        if self.replay.playing:
            self.set_paused(True)
        released = self.replay.step()
        steps = [e.step for e in released if type(e).__name__ == "BatchStep"]
        return steps[-1] if steps else -1

    def set_speed(self, speed: float) -> None:
        self.replay.set_speed(max(0.05, min(64.0, speed)))

    def restart(self) -> None:
        self.replay.seek(self._before_first_request())

    def seek_end(self) -> None:
        self.replay.advance_to(self.replay.end_ns)


class AttachController(Controller):
    """Watches a remote engine's `--trace-publish` address (no controls)."""

    mode = "attach"

    def __init__(self, addr: str):
        super().__init__()
        self.addr = addr
        self.title = addr
        self._sub = None
        self._offset: int | None = None  # remote clock - local clock

    def start(self, progress: Progress) -> None:
        from workbench.core.trace.bus import RemoteSubscription

        progress(f"connecting to {self.addr}")
        self._sub = RemoteSubscription(self.addr)

    def drain(self, max_items: int | None = None) -> list[Event]:
        if self._sub is None:
            return []
        out = self._sub.drain(max_items)
        if out and self._offset is None:
            # The remote host's monotonic clock is unrelated to ours: anchor on its first event.
            self._offset = max(e.ts for e in out) - time.monotonic_ns()
        return out

    def now_ns(self) -> int:
        return time.monotonic_ns() + (self._offset or 0)

    def status(self) -> str:
        got = "" if self._offset is not None else " (waiting for events…)"
        return f"ATTACHED {self.addr}{got}"

    def close(self) -> None:
        if self._sub is not None:
            _quietly(self._sub.close)
            self._sub = None


# Event fields that hold a monotonic timestamp of the publisher's clock (shifted onto ours).
_CLOCK_FIELDS = ("ts", "start_ts", "arrival_ts", "queued_ts", "first_token_ts", "finish_ts")
_PSEUDO_PROCS = ("bus", "recorder", "replay")


class MultiAttachController(Controller):
    """Watches several `--trace-publish` addresses at once: the workers behind a router
    (sglang-router), side by side. Worker i's scheduler is shown as data-parallel replica i
    (its events' proc becomes "scheduler.dp<i>", so the Queues, KV and tree panels split by
    worker as they do by replica) and its other processes as "<proc>.w<i>". Each publisher's
    clock is anchored on its first event, as in AttachController. Cumulative counters and resets
    are per worker and would overwrite each other, so they are left out; the views count from the
    events themselves."""

    mode = "attach"

    def __init__(self, addrs: list[str]):
        super().__init__()
        self.addrs = list(addrs)
        self.title = " + ".join(self.addrs)
        self._subs: list = []
        self._offsets: dict[int, int] = {}  # worker -> its clock - ours
        self.roles: dict[int, str] = {}  # worker -> "prefill" | "decode" (a disaggregated pair, from its pd.* events)

    def start(self, progress: Progress) -> None:
        from workbench.core.trace.bus import RemoteSubscription

        for i, addr in enumerate(self.addrs):
            progress(f"connecting to worker {i}: {addr}")
            self._subs.append(RemoteSubscription(addr))

    def drain(self, max_items: int | None = None) -> list[Event]:
        from workbench.core.trace import events as ev

        out: list[Event] = []
        for i, sub in enumerate(self._subs):
            got = sub.drain(max_items)
            if not got:
                continue
            if i not in self._offsets:
                self._offsets[i] = max(e.ts for e in got) - time.monotonic_ns()
            for e in got:
                if isinstance(e, (ev.TraceCounters, ev.TraceReset)):
                    continue
                out.append(self._as_worker(e, i))
        out.sort(key=lambda e: e.ts)
        return out

    def _as_worker(self, e: Event, i: int) -> Event:
        if isinstance(e, (_ev.PDBootstrap, _ev.PDReserved)) and e.proc.startswith("scheduler"):
            self.roles[i] = getattr(e, "role", "decode")  # pd.reserved: only a decode server reserves
        return as_worker(e, i, self._offsets[i])

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def status(self) -> str:
        waiting = [a for i, a in enumerate(self.addrs) if i not in self._offsets]
        got = f" (waiting for events from {', '.join(waiting)})" if waiting else ""
        if self.roles:  # a disaggregated pair: say which server is which
            names = ", ".join(f"dp{i} {self.roles.get(i, '?')}" for i in range(len(self.addrs)))
            return f"ATTACHED {len(self.addrs)} servers ({names}){got}"
        return f"ATTACHED {len(self.addrs)} workers (dp0..dp{len(self.addrs) - 1} in this order){got}"

    def close(self) -> None:
        for sub in self._subs:
            _quietly(sub.close)
        self._subs = []


def as_worker(e: Event, i: int, offset_ns: int) -> Event:
    """Event `e` of worker `i` (of several traces shown as one) renamed in place: its scheduler is
    data-parallel replica i ("scheduler.dp<i>"), its other processes "<proc>.w<i>", and its clock
    fields shifted by `offset_ns` (its clock - ours) onto ours."""
    for name in _CLOCK_FIELDS:
        v = getattr(e, name, None)
        if isinstance(v, int) and v:
            setattr(e, name, v - offset_ns)
    if e.proc.startswith("scheduler"):
        e.proc = f"scheduler.dp{i}"
    elif e.proc and e.proc not in _PSEUDO_PROCS:
        e.proc = f"{e.proc}.w{i}"
    if hasattr(e, "replica"):  # req.snapshot: the replica that holds the request
        e.replica = f"scheduler.dp{i}"
    return e


def _quietly(fn, *args):
    try:
        return fn(*args)
    except Exception:
        return None


def _ensure_resource_tracker() -> None:
    """Start multiprocessing's resource tracker with a real stderr.

    Spawning a child starts the tracker on first use and hands it sys.stderr's fd;
    under Textual sys.stderr is a capture object whose fileno() is -1, which makes
    the spawn fail ("bad value(s) in fds_to_keep")."""
    import os
    import sys
    from multiprocessing import resource_tracker

    saved = sys.stderr
    try:
        try:
            os.fstat(sys.stderr.fileno())
        except (OSError, ValueError, AttributeError):
            sys.stderr = sys.__stderr__
        resource_tracker.ensure_running()
    finally:
        sys.stderr = saved


def friendly(exc: BaseException) -> str:
    """One line for people: the message of errors meant for them, type + message otherwise."""
    name = type(exc).__name__
    msg = " ".join(str(exc).split())
    if name in (
        "ModelLoadError",
        "ValueError",
        "ControlUnavailable",
        "EngineDeadError",
        "FileNotFoundError",
        "TraceFormatError",
    ):
        return msg or name
    if "address" in msg.lower() and ("in use" in msg.lower() or isinstance(exc, OSError)):
        return f"address already in use or unavailable ({msg}): pick another port / --trace-publish address"
    return f"{name}: {msg}" if msg else name
