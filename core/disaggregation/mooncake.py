"""Mooncake's transfer engine as the KV transport (``--disaggregation-transfer-backend mooncake``).

The same roles and the same public interface as transfer.py's KVSender / KVReceiver, so prefill.py and
decode.py use either unchanged. What differs is who moves the bytes: as in SGLang's mooncake backend, the
decode side registers a receive buffer with its TransferEngine and tells the prefill side where it is; the
prefill side writes the KV straight into that buffer (Mooncake's ``batch_transfer_sync_write``, one call per
layer), and the bootstrap connection only carries small control frames (transfer.py's framing):

    decode  -> prefill  frame  {"magic", "room", "layout", "session", "addr"}   the room, its KV shape, and
                                                                                where to write it
    prefill -> decode   frame  {"ok", "error", "meta", "nbytes": 0}             the room is put: writes begin
    prefill  => decode  Mooncake writes k[i] v[i] into addr, then a frame {"ok", "nbytes": written so far}
                        per layer (an error frame instead if a write fails)
    decode  -> prefill  frame  {"ok": true}                                     the ack: the prefill frees it

The buffer is one contiguous block of layout.nbytes laid out k[0] v[0] k[1] v[1] ...; the k and v tensors the
receiver hands back are views of it. The decode side frees the buffer only once the prefill side can no longer
write into it (it sent its last frame or closed the connection); a buffer whose writer may still be busy (a
timeout mid-transfer) is parked for good rather than freed under it.

``pip install mooncake-transfer-engine-non-cuda`` gives the engine without CUDA; it speaks TCP everywhere and
RDMA where the machine has an RDMA NIC. docs/disaggregation.md (The Mooncake backend) says how to run it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import msgspec
import torch
from workbench.core.disaggregation.transfer import (
    KVLayout,
    KVReceiver,
    KVSender,
    RoomInUseError,
    TransferStatus,
    _Closed,
    _Held,
    _peer_gone,
    _Pull,
    _read_frame,
    _Reply,
    _Timeout,
    _write_frame,
)

MAGIC = "workbench-kv-mooncake/1"
INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda; it also needs the system libraries libibverbs1 libnl-3-200 "
    "libnl-route-3-200 (apt install libibverbs1 libnl-3-200 libnl-route-3-200)"
)


def load_transfer_engine() -> type:
    """Mooncake's TransferEngine class, or a RuntimeError that says what to install."""
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as exc:  # OSError: the wheel is there but a system library is not
        raise RuntimeError(
            f"--disaggregation-transfer-backend mooncake cannot import mooncake.engine ({exc}): {INSTALL_HINT}; "
            "or use --disaggregation-transfer-backend tcp (built in)"
        ) from exc
    return TransferEngine


def local_hostname(host: str) -> str:
    """The address a peer reaches this machine's transfer engine on: host itself unless it is a wildcard."""
    if host in ("", "0.0.0.0", "::"):
        with contextlib.suppress(OSError):
            return socket.gethostbyname(socket.gethostname())
        return "127.0.0.1"
    return host


def _new_engine(hostname: str, protocol: str):
    engine = load_transfer_engine()()
    # P2PHANDSHAKE: no metadata server; a peer is named "host:rpc_port" and asked for its buffers directly
    rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise RuntimeError(
            f"Mooncake's transfer engine did not start on {hostname} over {protocol} (rc {rc}): is {hostname} an "
            "address of this machine? (--host)"
        )
    return engine


class _Ask(msgspec.Struct):
    magic: str
    room: int
    layout: KVLayout
    # defaults so a tcp decode side's request (no session, no buffer) still decodes and gets the protocol error
    session: str = ""  # the decode side's engine, "host:rpc_port"
    addr: int = 0  # its registered receive buffer: layout.nbytes, k[0] v[0] k[1] v[1] ...


class MooncakeKVSender(KVSender):
    """The prefill side: holds rooms like KVSender (put/fail/poll/pending/close, same expiry and errors) and
    writes each one into the buffer its decode server registered, one Mooncake batch write per layer."""

    def __init__(self, host: str, port: int, *, hold_timeout_s: float = 120.0, protocol: str = "tcp"):
        """Bind the bootstrap port (as KVSender) and start a Mooncake engine on host over protocol (tcp/rdma)."""
        self.engine = _new_engine(local_hostname(host), protocol)
        super().__init__(host, port, hold_timeout_s=hold_timeout_s)

    def _handle(self, conn: socket.socket, addr) -> None:
        peer, room = f"{addr[0]}:{addr[1]}", None
        try:
            conn.settimeout(10.0)  # a peer that connects and says nothing is not a decode server
            ask = _read_frame(conn, _Ask)
            if ask.magic != MAGIC:
                error = f"unknown protocol {ask.magic!r}; this port speaks {MAGIC}: run both servers with "
                _write_frame(conn, _Reply(ok=False, error=error + "the same --disaggregation-transfer-backend"))
                return
            with self._cond:
                if ask.room not in self._asked:  # one connection per room: a second asker is a reused room
                    room = ask.room
                    self._asked.add(room)
            if room is None:
                error = f"bootstrap room {ask.room} is already being pulled by another decode connection: every "
                _write_frame(conn, _Reply(ok=False, error=error + "request needs its own bootstrap_room"))
                return
            held = self._wait_for(ask.room, conn)
            if held is not None:
                try:
                    self._write(conn, ask, held, peer)
                finally:
                    self._finish(ask.room, held, None)
        except (OSError, msgspec.MsgspecError, _Closed, _Timeout):
            pass  # a broken request: nothing was claimed, so there is nothing to report
        finally:
            with self._cond:
                self._asked.discard(room)
                self._conns.discard(conn)
            conn.close()

    def _write(self, conn: socket.socket, ask: _Ask, held: _Held, peer: str) -> None:
        room, want = ask.room, ask.layout
        wait_ms = (time.monotonic() - held.put_at) * 1e3

        def fail(error: str, sent: int = 0, ms: float = 0.0) -> None:
            self._finish(room, held, TransferStatus(room, False, sent, ms, error, held.meta, wait_ms=wait_ms))

        if held.error is not None:
            fail(held.error)
            _write_frame(conn, _Reply(ok=False, error=held.error))
            return
        assert held.k is not None and held.v is not None
        have = KVLayout.of(held.k, held.v)
        if have != want:
            error = (
                f"KV layout mismatch for bootstrap room {room}: the decode side reserved {want}, the prefill side "
                f"has {have}; run both servers with the same model and --dtype, and reserve the prompt's token count"
            )
            fail(error)
            _write_frame(conn, _Reply(ok=False, error=error))
            return
        ks = [t.contiguous() for t in held.k]
        vs = [t.contiguous() for t in held.v]
        size = have.tensor_nbytes
        srcs = [t.data_ptr() for pair in zip(ks, vs) for t in pair]
        sent, start, registered = 0, time.perf_counter(), False
        try:
            conn.settimeout(self.hold_timeout_s)
            if self.engine.batch_register_memory(srcs, [size] * len(srcs)) != 0:
                raise RuntimeError("Mooncake could not register the prefill side's host copy of the KV")
            registered = True
            _write_frame(conn, _Reply(ok=True, meta=held.meta, nbytes=0))
            for i in range(have.layer_num):
                if _peer_gone(conn):  # cancelled: stop writing into a buffer the decode side gave up
                    raise _Closed
                dst = ask.addr + 2 * i * size
                rc = self.engine.batch_transfer_sync_write(
                    ask.session, srcs[2 * i : 2 * i + 2], [dst, dst + size], [size, size]
                )
                if rc != 0:
                    error = (
                        f"Mooncake could not write layer {i} of bootstrap room {room} into the decode side's buffer "
                        f"at {ask.session} (rc {rc}): can the prefill server reach the decode server's --host?"
                    )
                    _write_frame(conn, _Reply(ok=False, error=error, nbytes=sent))
                    fail(error, sent, (time.perf_counter() - start) * 1e3)
                    return
                sent += 2 * size
                _write_frame(conn, _Reply(ok=True, nbytes=sent))
            if not _read_frame(conn, _Reply).ok:
                raise _Closed
        except (OSError, RuntimeError, msgspec.MsgspecError, _Closed, _Timeout) as exc:
            why = type(exc).__name__ if isinstance(exc, (_Closed, _Timeout)) else str(exc)
            error = (
                f"decode side {peer} went away after {sent} of {have.nbytes} KV bytes of bootstrap room {room} "
                f"({why}); the room is dropped, the decode server's log says why"
            )
            fail(error, sent, (time.perf_counter() - start) * 1e3)
            return
        finally:
            if registered:
                self.engine.batch_unregister_memory(srcs)
        ms = (time.perf_counter() - start) * 1e3
        self._finish(room, held, TransferStatus(room, True, sent, ms, None, held.meta, wait_ms=wait_ms))


def _writer_gone(sock: socket.socket, grace_s: float = 2.0) -> bool:
    """Tell the prefill side we are leaving (it stops between layers and closes) and wait up to grace_s for it
    to close: True once it has, so nothing more can be written into our buffer."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + grace_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv(1 << 16) == b"":
                return True
    except TimeoutError:
        return False
    except OSError:
        return True  # reset: the connection is gone, and with it the prefill side's writer
    return False


class MooncakeKVReceiver(KVReceiver):
    """The decode side: per room, registers a receive buffer with its Mooncake engine, asks the prefill server's
    bootstrap port to write the room's KV there, and returns k and v as views of it (submit/cancel/poll/
    in_flight/close as KVReceiver, the same errors)."""

    def __init__(
        self,
        *,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 5.0,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
    ):
        """hostname: where prefill servers reach this side's Mooncake engine; protocol: tcp or rdma."""
        super().__init__(timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
        self.engine = _new_engine(hostname, protocol)
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self._parked: list[torch.Tensor] = []  # buffers a prefill may still write into: never freed

    def submit(self, room: int, host: str, port: int, layout: KVLayout) -> None:
        """Start receiving a room from host:port into a fresh buffer of layout. Returns at once; raises
        RoomInUseError if this receiver already has the room in flight."""
        _ = layout.torch_dtype
        with self._lock:
            if room in self._pulls:
                raise RoomInUseError(
                    f"bootstrap room {room} is already being received by this decode server: every request needs "
                    "its own bootstrap_room"
                )
            pull = self._pulls[room] = _Pull(room, host, port, layout)
        threading.Thread(target=self._run, args=(pull,), name=f"kv-mooncake:{room}", daemon=True).start()

    def cancel(self, room: int) -> None:
        """Give up on a room: no status is reported for it afterwards. Only our half of the connection is shut,
        so the prefill side stops writing and closes it, and only then is the buffer freed."""
        with self._lock:
            pull = self._pulls.pop(room, None)
            if pull is None:
                return
            pull.cancelled = True
            sock = pull.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)

    def _pull(self, pull: _Pull) -> TransferStatus:
        room, layout, where = pull.room, pull.layout, f"{pull.host}:{pull.port}"
        start = time.monotonic()
        deadline = start + self.timeout_s
        sock = self._connect(pull)
        if isinstance(sock, TransferStatus):
            return sock
        buf = torch.empty(layout.nbytes, dtype=torch.uint8)
        if self.engine.register_memory(buf.data_ptr(), layout.nbytes) != 0:
            return TransferStatus(room, False, 0, 0.0, "Mooncake could not register the decode side's KV buffer")
        # whether the prefill side can no longer write into buf: from the ask on it may (even while we wait for
        # its first reply, it may have claimed the room), until it says it is done or closes the connection
        writer_done = False
        reply: _Reply | None = None
        try:
            _write_frame(sock, _Ask(MAGIC, room, layout, self.session, buf.data_ptr()))
            reply = _read_frame(sock, _Reply, deadline)
            wait_ms = (time.monotonic() - start) * 1e3
            if not reply.ok:
                writer_done = True
                return TransferStatus(room, False, 0, 0.0, reply.error, wait_ms=wait_ms)
            began = time.perf_counter()
            while pull.got[0] < layout.nbytes:
                step = _read_frame(sock, _Reply, deadline)
                if not step.ok:
                    writer_done = True
                    return TransferStatus(room, False, pull.got[0], 0.0, step.error, reply.meta, wait_ms=wait_ms)
                if not pull.got[0] < step.nbytes <= layout.nbytes:
                    raise msgspec.ValidationError(f"a progress frame of {step.nbytes} bytes after {pull.got[0]}")
                pull.got[0] = step.nbytes
            writer_done = True
            ms = (time.perf_counter() - began) * 1e3
            _write_frame(sock, _Reply(ok=True))  # the ack
            k, v = self._views(buf, layout)
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
            writer_done = writer_done or isinstance(exc, _Closed)  # it closed: it writes no more
            how = "closed the connection" if isinstance(exc, _Closed) else f"closed the connection ({exc})"
            error = (
                f"the prefill server at {where} {how} after {pull.got[0]} of {layout.nbytes} KV bytes of bootstrap "
                f"room {room}: did it exit? its log says why"
            )
        except msgspec.MsgspecError as exc:
            error = f"{where} sent a malformed reply for bootstrap room {room} ({exc}): is it a workbench prefill?"
        finally:
            if writer_done or _writer_gone(sock):
                self.engine.unregister_memory(buf.data_ptr())
            else:
                with self._lock:
                    self._parked.append(buf)  # a write may still land: keep the memory alive
        return TransferStatus(room, False, pull.got[0], 0.0, error)

    @staticmethod
    def _views(buf: torch.Tensor, layout: KVLayout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        size, shape = layout.tensor_nbytes, (layout.num_tokens, layout.head_num, layout.head_dim)
        k, v = [], []
        for i in range(layout.layer_num):
            k.append(buf[2 * i * size : (2 * i + 1) * size].view(layout.torch_dtype).view(shape))
            v.append(buf[(2 * i + 1) * size : (2 * i + 2) * size].view(layout.torch_dtype).view(shape))
        return k, v
