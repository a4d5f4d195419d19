"""The built-in KV transport for PD disaggregation: plain TCP, the decode side pulls.

The prefill server listens on its *bootstrap port* (``--disaggregation-bootstrap-port``). SGLang's router
puts a *bootstrap room* (a random uint64) in every request together with that host and port, so both
servers name the request the same way. The decode server reserves KV slots for the prompt, then opens
one TCP connection per room to the prefill server and asks for it:

    decode  -> prefill  frame  {"magic", "room", "layout"}        which room, and the KV shape it reserved
    prefill -> decode   frame  {"ok", "error", "meta", "nbytes"}  sent as soon as the room's KV is put
                                                                  (it may already be there, or come later)
    prefill -> decode   raw    k[0] v[0] k[1] v[1] ...            per layer, each tensor's bytes in row-major order
    decode  -> prefill  frame  {"ok": true}                       the ack: only now does the prefill side free it

A frame is a 4-byte big-endian length and a small msgspec JSON body. An error reply (the prefill failed the
room, the layouts differ, another connection already asked for the room) has no raw part. The KV travels per
layer so the decode side can fill its preallocated tensors as layers arrive; any dtype goes as raw bytes
(bf16 included), so what arrives equals what was sent bit for bit.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass

import msgspec
import torch

MAGIC = "workbench-kv/1"
_LEN = struct.Struct("!I")
_MAX_FRAME = 1 << 20  # headers are tiny: a bigger length means the peer does not speak this protocol


class RoomInUseError(ValueError):
    """A bootstrap room that is already in use on this side (each in-flight request needs its own room)."""


@dataclass(frozen=True)
class KVLayout:
    """The KV shape of one room: per layer, k and v are each [num_tokens, head_num, head_dim] of dtype.

    The decode side sends the layout it reserved; the prefill side compares it with the tensors it holds, so
    two servers running different models (or a different prompt length) fail loudly instead of decoding garbage.
    """

    num_tokens: int
    layer_num: int
    head_num: int
    head_dim: int
    dtype: str  # str(torch dtype), e.g. "torch.float32"

    @classmethod
    def none(cls, num_tokens: int) -> KVLayout:
        """The layout of a room without KV tensors (a simulated server's): only the meta travels."""
        return cls(num_tokens, 0, 0, 0, "none")

    @property
    def kvless(self) -> bool:
        """Whether no tensors travel (KVLayout.none): the room's meta alone is handed over."""
        return self.layer_num == 0

    @classmethod
    def of(cls, k: list[torch.Tensor], v: list[torch.Tensor]) -> KVLayout:
        """The layout of per-layer k and v tensors (raises ValueError when they are not one consistent KV)."""
        if not k or len(k) != len(v):
            raise ValueError(f"need the same non-zero number of k and v layers, got {len(k)} and {len(v)}")
        shape, dtype = tuple(k[0].shape), k[0].dtype
        for t in (*k, *v):
            if tuple(t.shape) != shape or t.dtype != dtype or t.dim() != 3 or t.device.type != "cpu":
                raise ValueError(
                    "every k and v tensor must be a CPU tensor [num_tokens, head_num, head_dim] of one shape and "
                    f"dtype; got {tuple(t.shape)} {t.dtype} on {t.device} next to {shape} {dtype}"
                )
        return cls(shape[0], len(k), shape[1], shape[2], str(dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype.removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown KV dtype {self.dtype!r}: use str() of a torch dtype, e.g. 'torch.bfloat16'")
        return dt

    @property
    def tensor_nbytes(self) -> int:
        """Bytes of one k (or v) tensor of one layer."""
        return self.num_tokens * self.head_num * self.head_dim * self.torch_dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole room's KV: 2 (k, v) * layers * tokens * heads * head_dim * itemsize."""
        return 0 if self.kvless else 2 * self.layer_num * self.tensor_nbytes


@dataclass
class TransferMeta:
    """What travels with the KV besides the tensors."""

    rid: str  # the prefill side's request id (for logs and the trace)
    first_token: int  # the token the prefill side sampled after the prompt
    first_logprob: float | None = None
    num_tokens: int = 0  # the prompt tokens whose KV this is (a link model times a kv-less room by them)


@dataclass
class TransferStatus:
    """One finished transfer, on either side. nbytes is the KV bytes moved (all of them when ok)."""

    room: int
    ok: bool
    nbytes: int
    ms: float  # the KV bytes on the wire: from the reply header to the ack (sender) or the last byte (receiver)
    error: str | None = None
    meta: TransferMeta | None = None
    k: list[torch.Tensor] | None = None  # receiver side, on success: per layer [num_tokens, head_num, head_dim]
    v: list[torch.Tensor] | None = None
    wait_ms: float = 0.0  # before the bytes: the room waiting for a decode server (sender), or for its KV (receiver)


class _Request(msgspec.Struct):
    magic: str
    room: int
    layout: KVLayout


class _Reply(msgspec.Struct):
    ok: bool
    error: str | None = None
    meta: TransferMeta | None = None
    nbytes: int = 0


class _Closed(Exception):
    """The peer closed the connection."""


class _Timeout(Exception):
    """The deadline passed."""


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None, progress: list[int] | None = None):
    """Fill view from sock; progress[0] counts the bytes as they come (for the error that names them)."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Timeout
            sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            raise _Timeout from None
        if n == 0:
            raise _Closed
        got += n
        if progress is not None:
            progress[0] += n


def _write_frame(sock: socket.socket, msg: msgspec.Struct) -> None:
    body = msgspec.json.encode(msg)
    sock.sendall(_LEN.pack(len(body)) + body)


def _read_frame(sock: socket.socket, kind: type, deadline: float | None = None):
    head = bytearray(_LEN.size)
    _recv_into(sock, memoryview(head), deadline)
    (length,) = _LEN.unpack(head)
    if length > _MAX_FRAME:
        raise msgspec.DecodeError(f"a {length}-byte header: the peer does not speak {MAGIC}")
    body = bytearray(length)
    _recv_into(sock, memoryview(body), deadline)
    return msgspec.json.decode(body, type=kind)


def _byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, shared with it (no copy): dtype-agnostic, so bf16 travels bit for bit."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def _peer_gone(sock: socket.socket) -> bool:
    """Whether a connection that should be silent (waiting for its room) was closed by the peer."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


@dataclass
class _Held:
    meta: TransferMeta | None
    k: list[torch.Tensor] | None
    v: list[torch.Tensor] | None
    error: str | None  # set by fail(): the decode side receives this instead of KV
    put_at: float
    claimed: bool = False  # a decode connection is sending it: it no longer expires


class KVSender:
    """The prefill side: owns the bootstrap port and hands each room's KV to the decode server that asks for it.

    A thread accepts connections (and expires unclaimed rooms); each connection gets its own thread, so many
    decode servers pull at once and put() never waits on the network.
    """

    def __init__(self, host: str, port: int, *, hold_timeout_s: float = 120.0):
        """Bind host:port now (port 0 picks a free one; self.port says which). A room nobody claims within
        hold_timeout_s is dropped, and so is a decode connection that stalls that long mid-transfer."""
        self.hold_timeout_s = hold_timeout_s
        self._listener = socket.create_server((host, port))
        self.host, self.port = host, self._listener.getsockname()[1]
        self._cond = threading.Condition()
        self._rooms: dict[int, _Held] = {}
        self._asked: set[int] = set()  # rooms a connection is waiting for or receiving: one connection per room
        self._done: list[TransferStatus] = []
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"kv-sender:{self.port}", daemon=True)
        self._thread.start()

    def put(self, room: int, meta: TransferMeta, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Hold a room's KV (per layer [num_tokens, head_num, head_dim] CPU tensors, the caller's own copies) until
        a decode server pulls it. Returns at once; raises RoomInUseError if the room is held already. No
        tensors at all (k and v empty: a simulated server's) hands over the meta alone, to a kv-less layout."""
        if k or v:
            KVLayout.of(k, v)  # a malformed KV is the caller's bug: say so here, not on the decode side
        with self._cond:
            if self._closed:
                raise RuntimeError("KVSender is closed")
            if room in self._rooms:
                raise RoomInUseError(
                    f"bootstrap room {room} is already held by this prefill server and not yet sent: every request "
                    "needs its own bootstrap_room (the router draws a random one; do not reuse it across requests)"
                )
            self._rooms[room] = _Held(meta, list(k), list(v), None, time.monotonic())
            self._cond.notify_all()

    def fail(self, room: int, message: str) -> None:
        """The prefill could not produce this room (aborted, bad input): the decode side receives message as its
        error. A room already being sent is left to finish."""
        with self._cond:
            held = self._rooms.get(room)
            if held is not None and held.claimed:
                return
            self._rooms[room] = _Held(held.meta if held else None, None, None, message, time.monotonic())
            self._cond.notify_all()

    def poll(self) -> list[TransferStatus]:
        """Rooms finished since the last poll: sent (ok), failed, or expired unclaimed after hold_timeout_s."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def pending(self) -> int:
        """Rooms held (put or failed, not yet delivered nor expired): 0 when nothing leaks."""
        with self._cond:
            return len(self._rooms)

    def close(self) -> None:
        """Stop listening, drop every connection and free every held room."""
        with self._cond:
            self._closed = True
            self._rooms.clear()
            conns = list(self._conns)
            self._cond.notify_all()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        self._listener.close()

    def _serve(self) -> None:
        # select with a short timeout rather than a blocking accept(): the same loop expires rooms, and close()
        # needs no trick to wake it
        while not self._closed:
            try:
                readable, _, _ = select.select([self._listener], [], [], 0.05)
                if readable:
                    conn, addr = self._listener.accept()
                    with self._cond:
                        self._conns.add(conn)
                    threading.Thread(target=self._handle, args=(conn, addr), daemon=True).start()
            except (OSError, ValueError):
                if self._closed:
                    return
            self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cond:
            for room, held in list(self._rooms.items()):
                if not held.claimed and now - held.put_at > self.hold_timeout_s:
                    del self._rooms[room]
                    error = (
                        f"bootstrap room {room} was not claimed by any decode server within {self.hold_timeout_s:g} "
                        "s, so its KV is dropped: was the request routed to a decode server (the router's --decode "
                        f"URLs), with bootstrap_port {self.port}?"
                    )
                    wait_ms = (now - held.put_at) * 1e3
                    self._done.append(TransferStatus(room, False, 0, 0.0, error, held.meta, wait_ms=wait_ms))

    def _finish(self, room: int, held: _Held, status: TransferStatus | None) -> None:
        with self._cond:
            if self._rooms.get(room) is held:
                del self._rooms[room]  # the tensors go with it: the sender keeps nothing of a finished room
                status = status or TransferStatus(room, False, 0, 0.0, "internal error while sending", held.meta)
            if status is not None:
                self._done.append(status)

    def _handle(self, conn: socket.socket, addr) -> None:
        peer, room = f"{addr[0]}:{addr[1]}", None
        try:
            conn.settimeout(10.0)  # a peer that connects and says nothing is not a decode server
            req = _read_frame(conn, _Request)
            if req.magic != MAGIC:
                _write_frame(conn, _Reply(ok=False, error=f"unknown protocol {req.magic!r}; this port speaks {MAGIC}"))
                return
            with self._cond:
                if req.room not in self._asked:  # one connection per room: a second asker is a reused room
                    room = req.room
                    self._asked.add(room)
            if room is None:
                error = f"bootstrap room {req.room} is already being pulled by another decode connection: every "
                _write_frame(conn, _Reply(ok=False, error=error + "request needs its own bootstrap_room"))
                return
            held = self._wait_for(req.room, conn)
            if held is not None:
                try:
                    self._send(conn, req.room, held, req.layout, peer)
                finally:  # _send reports every failure it expects; this is for the ones it does not
                    self._finish(req.room, held, None)
        except (OSError, msgspec.MsgspecError, _Closed, _Timeout):
            pass  # a broken request: nothing was claimed, so there is nothing to report
        finally:
            with self._cond:
                self._asked.discard(room)
                self._conns.discard(conn)
            conn.close()

    def _wait_for(self, room: int, conn: socket.socket) -> _Held | None:
        """Block until the room is put (claiming it), the decode side hangs up, or the sender closes."""
        while True:
            with self._cond:
                if self._closed:
                    return None
                held = self._rooms.get(room)
                if held is not None:
                    held.claimed = True
                    return held
                self._cond.wait(0.1)  # put() notifies; the timeout is only to notice a peer that gave up
            if _peer_gone(conn):
                return None

    def _send(self, conn: socket.socket, room: int, held: _Held, want: KVLayout, peer: str) -> None:
        wait_ms = (time.monotonic() - held.put_at) * 1e3
        if held.error is not None:
            self._finish(room, held, TransferStatus(room, False, 0, 0.0, held.error, held.meta, wait_ms=wait_ms))
            _write_frame(conn, _Reply(ok=False, error=held.error))
            return
        assert held.k is not None and held.v is not None
        have = KVLayout.of(held.k, held.v) if held.k else KVLayout.none(want.num_tokens)
        if have != want:
            error = (
                f"KV layout mismatch for bootstrap room {room}: the decode side reserved {want}, the prefill side "
                f"has {have}; run both servers with the same model and --dtype, and reserve the prompt's token count"
            )
            self._finish(room, held, TransferStatus(room, False, 0, 0.0, error, held.meta, wait_ms=wait_ms))
            _write_frame(conn, _Reply(ok=False, error=error))
            return
        sent, start = 0, time.perf_counter()
        try:
            conn.settimeout(self.hold_timeout_s)  # a decode side that stops reading must not hold the room forever
            _write_frame(conn, _Reply(ok=True, meta=held.meta, nbytes=have.nbytes))
            for k, v in zip(held.k, held.v):
                for t in (k, v):
                    conn.sendall(_byte_view(t.contiguous()))
                    sent += have.tensor_nbytes
            if not _read_frame(conn, _Reply).ok:
                raise _Closed
        except (OSError, msgspec.MsgspecError, _Closed, _Timeout) as exc:
            why = type(exc).__name__ if isinstance(exc, (_Closed, _Timeout)) else str(exc)
            error = (
                f"decode side {peer} went away after {sent} of {have.nbytes} KV bytes of bootstrap room {room} "
                f"({why}); the room is dropped, the decode server's log says why"
            )
            ms = (time.perf_counter() - start) * 1e3
            self._finish(room, held, TransferStatus(room, False, sent, ms, error, held.meta, wait_ms=wait_ms))
            return
        ms = (time.perf_counter() - start) * 1e3
        self._finish(room, held, TransferStatus(room, True, sent, ms, None, held.meta, wait_ms=wait_ms))


class _Pull:
    def __init__(self, room: int, host: str, port: int, layout: KVLayout):
        self.room, self.host, self.port, self.layout = room, host, port, layout
        self.sock: socket.socket | None = None
        self.cancelled = False
        self.got = [0]  # KV bytes received so far (a list: _recv_into counts into it)


class KVReceiver:
    """The decode side: pulls rooms from prefill servers' bootstrap ports, one connection and thread per room."""

    def __init__(self, *, timeout_s: float = 120.0, connect_timeout_s: float = 5.0):
        """timeout_s bounds a whole pull (waiting for the prefill, then the bytes); connect_timeout_s the connect."""
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._lock = threading.Lock()
        self._pulls: dict[int, _Pull] = {}
        self._done: list[TransferStatus] = []

    def submit(self, room: int, host: str, port: int, layout: KVLayout) -> None:
        """Start pulling a room from host:port into fresh tensors of layout. Returns at once; raises
        RoomInUseError if this receiver already has the room in flight."""
        if not layout.kvless:
            _ = layout.torch_dtype  # an unknown dtype is the caller's bug: raise here, not in the pulling thread
        with self._lock:
            if room in self._pulls:
                raise RoomInUseError(
                    f"bootstrap room {room} is already being received by this decode server: every request needs "
                    "its own bootstrap_room"
                )
            pull = self._pulls[room] = _Pull(room, host, port, layout)
        threading.Thread(target=self._run, args=(pull,), name=f"kv-pull:{room}", daemon=True).start()

    def cancel(self, room: int) -> None:
        """Give up on a room (its request was aborted): no status is reported for it afterwards."""
        with self._lock:
            pull = self._pulls.pop(room, None)
            if pull is None:
                return
            pull.cancelled = True
            sock = pull.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the pulling thread's recv; the prefill side sees us leave

    def poll(self) -> list[TransferStatus]:
        """Pulls finished since the last poll: ok with meta, k and v, or an error that says what to do."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def in_flight(self) -> int:
        """Rooms submitted and neither finished nor cancelled."""
        with self._lock:
            return len(self._pulls)

    def close(self) -> None:
        """Cancel every pull in flight."""
        with self._lock:
            rooms = list(self._pulls)
        for room in rooms:
            self.cancel(room)

    def _run(self, pull: _Pull) -> None:
        try:
            status = self._pull(pull)
        except Exception as exc:  # e.g. no memory for the tensors: still a status, never a room stuck in flight
            status = TransferStatus(pull.room, False, pull.got[0], 0.0, f"{type(exc).__name__}: {exc}")
        finally:
            if pull.sock is not None:
                pull.sock.close()
        with self._lock:
            if pull.cancelled or self._pulls.get(pull.room) is not pull:
                return
            del self._pulls[pull.room]
            self._done.append(status)

    def _connect(self, pull: _Pull) -> socket.socket | TransferStatus:
        """The pull's connection to the prefill's bootstrap port, or the failed status to report (either backend)."""
        try:
            sock = socket.create_connection((pull.host, pull.port), timeout=self.connect_timeout_s)
        except OSError as exc:
            why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc)).lower()
            error = (
                f"could not reach the prefill server's bootstrap port at {pull.host}:{pull.port} ({why}): is the "
                f"prefill server running with --disaggregation-bootstrap-port {pull.port}?"
            )
            return TransferStatus(pull.room, False, 0, 0.0, error)
        with self._lock:
            pull.sock = sock
            if pull.cancelled:
                return TransferStatus(pull.room, False, 0, 0.0, "cancelled")
        return sock

    def _pull(self, pull: _Pull) -> TransferStatus:
        room, layout, where = pull.room, pull.layout, f"{pull.host}:{pull.port}"
        start = time.monotonic()
        deadline = start + self.timeout_s
        sock = self._connect(pull)
        if isinstance(sock, TransferStatus):
            return sock
        reply: _Reply | None = None
        try:
            _write_frame(sock, _Request(MAGIC, room, layout))
            reply = _read_frame(sock, _Reply, deadline)
            wait_ms = (time.monotonic() - start) * 1e3
            if not reply.ok:
                return TransferStatus(room, False, 0, 0.0, reply.error, wait_ms=wait_ms)
            if reply.nbytes != layout.nbytes:
                raise msgspec.ValidationError(f"the prefill side announced {reply.nbytes} bytes, not {layout.nbytes}")
            # preallocated from the layout, filled in place layer by layer as the bytes arrive
            shape = (layout.num_tokens, layout.head_num, layout.head_dim)
            k = [torch.empty(shape, dtype=layout.torch_dtype) for _ in range(layout.layer_num)]
            v = [torch.empty(shape, dtype=layout.torch_dtype) for _ in range(layout.layer_num)]
            began = time.perf_counter()
            for kt, vt in zip(k, v):
                _recv_into(sock, _byte_view(kt), deadline, pull.got)
                _recv_into(sock, _byte_view(vt), deadline, pull.got)
            ms = (time.perf_counter() - began) * 1e3
            _write_frame(sock, _Reply(ok=True))  # the ack
            return TransferStatus(room, True, pull.got[0], ms, None, reply.meta, k, v, wait_ms=wait_ms)
        except _Timeout:
            if reply is None:
                why = (
                    "the prefill server has not produced it (still queued or prefilling, or the request never reached "
                    "it: check that the router sends it there); raise the transfer timeout if prefills take this long"
                )
            else:
                why = f"only {pull.got[0]} of {layout.nbytes} KV bytes arrived: the link or the prefill server stalled"
            error = f"no KV for bootstrap room {room} from {where} within {self.timeout_s:g} s: {why}"
        except (_Closed, OSError) as exc:
            how = "closed the connection" if isinstance(exc, _Closed) else f"closed the connection ({exc})"
            error = (
                f"the prefill server at {where} {how} after {pull.got[0]} of {layout.nbytes} KV bytes of bootstrap "
                f"room {room}: did it exit? its log says why"
            )
        except msgspec.MsgspecError as exc:
            error = f"{where} sent a malformed reply for bootstrap room {room} ({exc}): is it a workbench prefill?"
        return TransferStatus(room, False, pull.got[0], 0.0, error)
