"""Tracer: the per-process emitter of trace events.

Call sites guard on a plain attribute so that, with nobody listening, tracing
costs one branch::

    if tracer.enabled:
        tracer.emit(ReqQueued(rid=req.rid, prompt_tokens=n, queue_len=len(q)))

`emit` only stamps and buffers (no encoding); `flush` sends the buffer as one
batch, once per scheduler step (and from idle loops). A child process sends
over a ZMQ PUSH socket with a small high-water mark and never blocks: when the
bus is behind, the batch is dropped and counted, and the next batch that gets
through starts with a `trace.dropped` event saying how many were lost. The
main process's tracer hands batches to the bus in-process (`sink=`).
A Tracer never raises into its caller: any error is logged once and the
events are dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq
from workbench.core.trace import clock as trace_clock
from workbench.core.trace.events import Event, TraceDropped, encode_batch

logger = logging.getLogger(__name__)


class Tracer:
    """One per process.

    Args:
        proc: name stamped on every event ("scheduler", "tokenizer", ...).
        endpoint: the bus's PULL endpoint (child processes).
        sink: a callable taking a batch (in-process tracers, e.g. `bus.publish_batch`).
        enabled: initial state; the engine switches tracers with `set_enabled`
            when the bus gains its first / loses its last listener.
        sndhwm: batches ZMQ may queue before sends start dropping.
        flush_interval_s: `emit` flushes by itself once the oldest buffered
            event is this old (None: only explicit flushes), so emitters
            without a step loop still deliver.
        max_buffer: `emit` flushes by itself at this many buffered events.
    """

    def __init__(
        self,
        proc: str,
        endpoint: str | None = None,
        sink: Callable[[list[Event]], None] | None = None,
        *,
        enabled: bool = False,
        sndhwm: int = 32,
        flush_interval_s: float | None = 0.25,
        max_buffer: int = 4096,
        clock: Callable[[], int] | None = None,
    ):
        self.proc = proc
        # Events' ts: the process's trace clock (trace/clock.py: simulated time in a simulated deployment's
        # processes) unless given (the offline simulator's own clock).
        self.clock = clock if clock is not None else trace_clock.now_ns
        self.endpoint = endpoint
        self.step = -1
        self.enabled = bool(enabled) and (endpoint is not None or sink is not None)
        self._sink = sink
        self._sndhwm = sndhwm
        self._flush_interval_ns = None if flush_interval_s is None else int(flush_interval_s * 1e9)
        self._max_buffer = max_buffer
        # deque append/popleft are atomic, so emit needs no lock even when a second
        # thread (e.g. an asyncio loop's executor) emits too; only flush takes one.
        self._buf: deque[Event] = deque()
        self._buf_first_ts = 0
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None
        self._broken = False
        self._logged: set[str] = set()
        self._pending_dropped = 0  # events lost since the last successful send
        self.dropped_total = 0  # events lost over the tracer's life
        self.sent_batches = 0
        self.sent_events = 0

    # ---- the hot path ---------------------------------------------------------

    def begin_step(self, step_id: int) -> None:
        """The scheduler calls this at the top of each iteration."""
        self.step = step_id

    def emit(self, event: Event) -> None:
        """Stamp ts (if 0), proc (if empty) and step (if -1), and buffer the event."""
        if not self.enabled:
            return
        try:
            if not event.ts:
                event.ts = self.clock()
            if not event.proc:
                event.proc = self.proc
            if event.step == -1:
                event.step = self.step
            buf = self._buf
            wall = time.monotonic_ns()  # the flush interval is this host's time, whatever the events' clock
            if not buf:
                self._buf_first_ts = wall
            buf.append(event)
            if len(buf) >= self._max_buffer or (
                self._flush_interval_ns is not None and wall - self._buf_first_ts >= self._flush_interval_ns
            ):
                self.flush()
        except Exception as e:  # tracing must never break serving
            self._log_once("emit", "trace emit failed: %r", e)

    def flush(self) -> None:
        """Send everything buffered as one batch; never blocks, never raises."""
        if not self._buf and not self._pending_dropped:
            return
        try:
            with self._lock:
                buf = self._buf
                batch = [buf.popleft() for _ in range(len(buf))]
                if not self.enabled:
                    return
                if self._sink is not None:
                    self._send_sink(self._sink, batch)
                elif self.endpoint is not None:
                    self._send_zmq(self.endpoint, batch)
        except Exception as e:
            self._log_once("flush", "trace flush failed: %r", e)

    # ---- control ----------------------------------------------------------------

    def set_enabled(self, enabled: bool) -> None:
        """Switch tracing on/off; switching off discards what is buffered."""
        enabled = bool(enabled) and (self.endpoint is not None or self._sink is not None)
        if not enabled:
            self.enabled = False
            with self._lock:
                self._buf.clear()
                self._pending_dropped = 0
        else:
            self.enabled = True

    def close(self) -> None:
        """Flush what is left, then close the socket (lingering briefly so it gets out)."""
        self.flush()
        self.enabled = False
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.close(linger=200)
                except Exception:
                    pass
                self._sock = None

    # ---- transports -------------------------------------------------------------

    def _drop(self, n: int) -> None:
        self._pending_dropped += n
        self.dropped_total += n

    def _dropped_marker(self) -> TraceDropped:
        return TraceDropped(ts=self.clock(), proc=self.proc, step=self.step, count=self._pending_dropped)

    def _send_sink(self, sink: Callable[[list[Event]], None], batch: list[Event]) -> None:
        n = len(batch)
        if self._pending_dropped:
            batch.insert(0, self._dropped_marker())
        try:
            sink(batch)
        except Exception as e:
            self._log_once("sink", "trace sink failed, dropping batch: %r", e)
            self._drop(n)
            return
        self._pending_dropped = 0
        self.sent_batches += 1
        self.sent_events += len(batch)

    def _socket(self, endpoint: str) -> zmq.Socket | None:
        if self._sock is None and not self._broken:
            try:
                sock: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, self._sndhwm)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
                self._sock = sock
            except Exception as e:
                self._broken = True
                self._log_once("connect", "trace socket to %s failed, tracing disabled: %r", endpoint, e)
        return self._sock

    def _send_zmq(self, endpoint: str, batch: list[Event]) -> None:
        sock = self._socket(endpoint)
        if sock is None:
            self._drop(len(batch))
            return
        n = len(batch)
        if self._pending_dropped:
            batch.insert(0, self._dropped_marker())
        data = encode_batch(batch)
        try:
            sock.send(data, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._drop(n)
            return
        except zmq.ZMQError as e:
            self._log_once("send", "trace send failed, dropping: %r", e)
            self._drop(n)
            return
        self._pending_dropped = 0
        self.sent_batches += 1
        self.sent_events += len(batch)

    def _log_once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(msg, *args)
