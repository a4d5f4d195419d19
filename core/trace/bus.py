"""TraceBus: the main process's hub for trace events.

Child tracers PUSH msgpack batches to the bus's PULL socket; the main
process's own tracer hands batches over in-process (`publish_batch`). A
daemon thread decodes each batch (msgspec, never pickle; a malformed message
is counted and skipped) and delivers it to every subscriber:

- `Subscription` (bounded queue): a subscriber that falls behind loses events
  and is told so with a `trace.dropped` event; nobody else is slowed down.
- callbacks (`subscribe_callback`), called on the bus thread (the recorder).
- optionally a ZMQ XPUB socket (`publish_addr`) for remote attach; the client
  side is `RemoteSubscription`. Each new remote subscriber triggers a header
  plus a snapshot of the current picture.

The bus keeps its own `TraceState` while it has listeners so a late
subscriber can start from a snapshot (`subscribe(with_snapshot=True)`);
the state is reset when the last listener leaves (tracers are switched off
then, so it would only go stale). `on_listeners_changed(bool)` fires on the
0->1 and 1->0 transitions of `listener_count`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq
from workbench.core.trace import clock as trace_clock
from workbench.core.trace.events import (
    SCHEMA_VERSION,
    Event,
    TraceDropped,
    TraceHeader,
    decode_batch,
    encode_batch,
)
from workbench.core.trace.state import TraceState

logger = logging.getLogger(__name__)

Batch = list[Event]


def drain_settled(sub, settle_s: float = 0.3, until=None, timeout_s: float = 30.0) -> list[Event]:
    """Everything a subscription receives until it has been quiet for `settle_s`. Trace events travel
    their own socket and may still be in flight when the request that caused them returns; with
    `until` (a predicate on the events so far), first wait up to `timeout_s` for it to hold."""
    out: list[Event] = []
    deadline = time.monotonic() + timeout_s
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < settle_s or (
        until is not None and not until(out) and time.monotonic() < deadline
    ):
        got = sub.drain()
        if got:
            out.extend(got)
            quiet_since = time.monotonic()
        else:
            time.sleep(0.02)
    return out


class Subscription:
    """A bounded, thread-safe queue of events fed by the bus.

    Events are shared with other subscribers: treat them as read-only.
    """

    def __init__(self, bus: TraceBus | None, maxsize: int = 100_000, name: str = ""):
        self.name = name
        self.maxsize = max(1, maxsize)
        self.dropped = 0  # events this subscriber lost
        self.closed = False
        self._bus = bus
        self._q: deque[Event] = deque()
        self._cond = threading.Condition()
        self._pending_dropped = 0

    def __len__(self) -> int:
        return len(self._q)

    def _offer(self, batch: Batch) -> None:
        # Never blocks: what does not fit is dropped for this subscriber only.
        with self._cond:
            if self.closed:
                return
            room = self.maxsize - len(self._q)
            if self._pending_dropped and room >= 1:
                self._q.append(TraceDropped(ts=trace_clock.now_ns(), proc="bus", count=self._pending_dropped))
                self._pending_dropped = 0
                room -= 1
            take = max(0, min(room, len(batch)))
            if take == len(batch):
                self._q.extend(batch)
            else:
                self._q.extend(batch[:take])
                lost = len(batch) - take
                self.dropped += lost
                self._pending_dropped += lost
            if take:
                self._cond.notify_all()

    def get(self, timeout: float | None = None) -> Event | None:
        """The next event; waits up to `timeout` s (None: until one comes or close). None if none."""
        with self._cond:
            if not self._q and not self.closed and timeout != 0:
                self._cond.wait_for(lambda: self._q or self.closed, timeout)
            return self._q.popleft() if self._q else None

    def drain(self, max_items: int | None = None) -> list[Event]:
        """Everything queued (at most max_items), without waiting."""
        with self._cond:
            n = len(self._q) if max_items is None else min(max_items, len(self._q))
            return [self._q.popleft() for _ in range(n)]

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        if self._bus is not None:
            self._bus._remove_subscription(self)
            self._bus = None

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CallbackHandle:
    """Returned by `subscribe_callback`; `close()` unsubscribes."""

    def __init__(self, bus: TraceBus, fn: Callable[[Batch], None], name: str):
        self.fn, self.name, self._bus = fn, name, bus

    def close(self) -> None:
        self._bus._remove_callback(self)


class TraceBus:
    """See the module docstring.

    Args:
        pull_endpoint: where child tracers connect (ipc://... or tcp://...;
            `tcp://127.0.0.1:*` picks a free port; the bound address is
            `bus.pull_endpoint`).
        publish_addr: optional XPUB address for remote attach (bound address
            in `bus.publish_endpoint`).
        model: written into the header sent to remote subscribers.
    """

    def __init__(
        self,
        pull_endpoint: str,
        publish_addr: str | None = None,
        *,
        model: str = "",
        rcvhwm: int = 1000,
        pub_sndhwm: int = 1000,
        max_inproc_batches: int = 10_000,
    ):
        self.model = model
        self.on_listeners_changed: Callable[[bool], None] | None = None
        self.state = TraceState()
        self.malformed = 0  # undecodable messages received and ignored
        self.received_batches = 0
        self.received_events = 0
        self.dropped_inproc = 0  # in-process events lost because the bus thread was behind
        self.pub_dropped = 0  # batches the remote publisher could not send
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, rcvhwm)
        self._pull.bind(pull_endpoint)
        self.pull_endpoint = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pub: zmq.Socket | None = None
        self.publish_endpoint: str | None = None
        if publish_addr:
            pub = self._ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, pub_sndhwm)
            # Every subscribe and unsubscribe (disconnects included) reaches us, so
            # remote attach counts as a listener for exactly as long as it lasts.
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            pub.setsockopt(zmq.XPUB_VERBOSER, 1)
            pub.bind(publish_addr)
            self.publish_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self._pub = pub
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._inproc: deque[Batch] = deque()
        self._max_inproc = max_inproc_batches
        self._inproc_pending_dropped = 0
        self._lock = threading.RLock()  # subscribers, callbacks, state
        self._hook_lock = threading.Lock()  # serializes on_listeners_changed calls
        self._subs: list[Subscription] = []
        self._callbacks: list[CallbackHandle] = []
        self._remote = 0
        self._active = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="trace-bus", daemon=True)
        self._thread.start()

    # ---- listeners ------------------------------------------------------------

    @property
    def listener_count(self) -> int:
        """In-process subscriptions + callbacks, + 1 while any remote subscriber is attached."""
        return len(self._subs) + len(self._callbacks) + (1 if self._remote > 0 else 0)

    def subscribe(self, maxsize: int = 100_000, name: str = "", with_snapshot: bool = False) -> Subscription:
        """A new bounded subscription. With `with_snapshot`, it first receives synthetic
        events rebuilding the bus's current picture (TraceState.snapshot_events)."""
        sub = Subscription(self, maxsize, name)
        with self._lock:
            if with_snapshot:
                sub._offer(self.state.snapshot_events())
            self._subs.append(sub)
        self._update_listeners()
        return sub

    def subscribe_callback(
        self, fn: Callable[[Batch], None], name: str = "", with_snapshot: bool = False
    ) -> CallbackHandle:
        """Call fn(batch) on the bus thread for every batch. An exception in fn is
        logged and removes the callback. With `with_snapshot`, fn first gets the
        snapshot batch, synchronously on the calling thread."""
        h = CallbackHandle(self, fn, name or getattr(fn, "__name__", "callback"))
        with self._lock:
            if with_snapshot:
                snap = self.state.snapshot_events()
                if snap:
                    fn(snap)
            self._callbacks.append(h)
        self._update_listeners()
        return h

    def _remove_subscription(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
        self._update_listeners()

    def _remove_callback(self, h: CallbackHandle) -> None:
        with self._lock:
            if h in self._callbacks:
                self._callbacks.remove(h)
        self._update_listeners()

    def _update_listeners(self) -> None:
        with self._hook_lock:
            active = self.listener_count > 0 and not self._closed
            if active == self._active:
                return
            self._active = active
            if not active:
                # Plain assignment (no _lock here, so the two locks never nest the
                # other way round); a batch being applied to the old state is harmless.
                self.state = TraceState()
            hook = self.on_listeners_changed
            if hook is not None:
                try:
                    hook(active)
                except Exception:
                    logger.exception("on_listeners_changed(%s) failed", active)

    # ---- input ------------------------------------------------------------------

    def publish_batch(self, events: Batch) -> None:
        """Hand a batch from an in-process tracer to the bus; thread-safe, never blocks."""
        if self._closed or not events:
            return
        if len(self._inproc) >= self._max_inproc:
            self.dropped_inproc += len(events)
            self._inproc_pending_dropped += len(events)
            return
        self._inproc.append(list(events))
        try:
            self._wake_w.send(b"\0")
        except OSError:  # the wake pipe is full: the thread is awake anyway
            pass

    # ---- the bus thread ---------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        if self._pub is not None:
            poller.register(self._pub, zmq.POLLIN)
        while not self._closed:
            try:
                ready = dict(poller.poll(1000))
                if self._wake_r.fileno() in ready:
                    self._drain_wake()
                self._pump_inproc()
                if self._pull in ready:
                    self._pump_pull()
                if self._pub is not None and self._pub in ready:
                    self._pump_xpub(self._pub)
            except Exception:
                if self._closed:
                    break
                logger.exception("trace bus loop error")
                time.sleep(0.01)
        for s in (self._pull, self._pub):
            if s is not None:
                s.close(linger=0)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _pump_inproc(self) -> None:
        if self._inproc_pending_dropped:
            n, self._inproc_pending_dropped = self._inproc_pending_dropped, 0
            self._deliver([TraceDropped(ts=trace_clock.now_ns(), proc="bus", count=n)])
        while self._inproc:
            self._deliver(self._inproc.popleft())

    def _pump_pull(self) -> None:
        for _ in range(1000):  # bounded, so in-process batches and XPUB get a turn
            try:
                data = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                batch = decode_batch(data)
            except Exception:  # msgspec decode/validation error: never pickle, just count
                self.malformed += 1
                continue
            self._deliver(batch, data)

    def _pump_xpub(self, pub: zmq.Socket) -> None:
        while True:
            try:
                msg = pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not msg:
                continue
            if msg[0] == 1:
                self._remote += 1
                self._update_listeners()
                with self._lock:
                    snap: Batch = [
                        TraceHeader(
                            ts=trace_clock.now_ns(), proc="bus", schema_version=SCHEMA_VERSION, model=self.model
                        )
                    ]
                    snap += self.state.snapshot_events()
                self._send_pub(pub, snap, None)
            elif msg[0] == 0:
                self._remote = max(0, self._remote - 1)
                self._update_listeners()

    def _deliver(self, batch: Batch, raw: bytes | None = None) -> None:
        self.received_batches += 1
        self.received_events += len(batch)
        with self._lock:
            try:
                self.state.apply_many(batch)
            except Exception:
                logger.exception("TraceState.apply failed; the bus's snapshot may be off")
            for sub in self._subs:
                sub._offer(batch)
            callbacks = list(self._callbacks)
        for h in callbacks:
            try:
                h.fn(batch)
            except Exception:
                logger.exception("trace callback %s failed; removing it", h.name)
                self._remove_callback(h)
        if self._pub is not None and self._remote > 0:
            self._send_pub(self._pub, batch, raw)

    def _send_pub(self, pub: zmq.Socket, batch: Batch, raw: bytes | None) -> None:
        try:
            pub.send(raw if raw is not None else encode_batch(batch), zmq.NOBLOCK)
        except zmq.ZMQError:
            self.pub_dropped += 1

    # ---- shutdown ---------------------------------------------------------------

    def close(self) -> None:
        """Stop the thread, close every subscription and socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        self._thread.join(timeout=5)
        with self._lock:
            subs, self._subs = list(self._subs), []
            self._callbacks = []
        for s in subs:
            s._bus = None
            s.close()
        self._remote = 0
        self._update_listeners()
        if not self._thread.is_alive():  # else a callback is stuck; term() would hang
            self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> TraceBus:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RemoteSubscription:
    """Client side of `--trace-publish`: a SUB socket yielding decoded events.

    Same `get/drain/close` surface as `Subscription`; use it from one thread.
    Messages that do not decode as a batch of trace events are counted in
    `malformed` and skipped (msgspec only, never pickle). Events lost in
    transit (the publisher drops when this client is slow) are not counted.
    """

    def __init__(self, addr: str, maxsize: int = 100_000, rcvhwm: int = 1000):
        self.addr = addr
        self.maxsize = maxsize
        self.malformed = 0
        self.dropped = 0
        self.closed = False
        self.header: TraceHeader | None = None
        self._q: deque[Event] = deque()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(addr)

    def _pump(self, timeout_ms: int) -> None:
        if self.closed:
            return
        if timeout_ms != 0 and not self._sock.poll(timeout_ms, zmq.POLLIN):
            return
        while len(self._q) < self.maxsize:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                batch = decode_batch(data)
            except Exception:
                self.malformed += 1
                continue
            for e in batch:
                if type(e) is TraceHeader:
                    self.header = e
                    if e.schema_version > SCHEMA_VERSION:
                        logger.warning(
                            "remote trace uses schema v%d, this client reads v%d", e.schema_version, SCHEMA_VERSION
                        )
            self._q.extend(batch)

    def get(self, timeout: float | None = None) -> Event | None:
        """The next event, waiting up to `timeout` s (None: until one comes)."""
        if not self._q:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._q and not self.closed:
                left = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
                self._pump(left)
                if deadline is not None and time.monotonic() >= deadline:
                    break
        return self._q.popleft() if self._q else None

    def drain(self, max_items: int | None = None) -> list[Event]:
        self._pump(0)
        n = len(self._q) if max_items is None else min(max_items, len(self._q))
        return [self._q.popleft() for _ in range(n)]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close(linger=0)
            self._ctx.term()

    def __enter__(self) -> RemoteSubscription:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
