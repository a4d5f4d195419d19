"""ZMQ plumbing: a private ipc:// directory, typed send/recv of io_struct messages."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field

import zmq
from workbench.core.io_struct import Msg, decode_msg, encode_msg


@dataclass
class PortArgs:
    """The ipc:// endpoints that join the processes (one private directory per engine)."""

    ipc_dir: str
    tokenizer_ipc_name: str  # detokenizer -> tokenizer manager (BatchStrOut) and control replies
    scheduler_input_ipc_name: str  # tokenizer manager -> scheduler
    detokenizer_ipc_name: str  # scheduler -> detokenizer
    trace_ipc_name: str  # every child's Tracer -> the bus in the main process
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls) -> PortArgs:
        # mkdtemp creates the directory with mode 0700: only this user can connect.
        d = tempfile.mkdtemp(prefix="workbench-ipc-")
        os.chmod(d, 0o700)
        ep = lambda name: f"ipc://{os.path.join(d, name)}"  # noqa: E731
        return cls(
            ipc_dir=d,
            tokenizer_ipc_name=ep("tokenizer"),
            scheduler_input_ipc_name=ep("scheduler"),
            detokenizer_ipc_name=ep("detokenizer"),
            trace_ipc_name=ep("trace"),
        )

    def endpoint(self, name: str) -> str:
        """Another ipc:// endpoint in this engine's private directory (e.g. per-replica sockets)."""
        return f"ipc://{os.path.join(self.ipc_dir, name)}"

    def cleanup(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def get_zmq_socket(context: zmq.Context, socket_type: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    if socket_type == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)  # serving messages are never dropped
    if socket_type == zmq.PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def send_msg(sock: zmq.Socket, msg: Msg, flags: int = 0) -> None:
    sock.send(encode_msg(msg), flags=flags, copy=False)


def recv_msg_nowait(sock: zmq.Socket) -> Msg | None:
    """One message if one is waiting, else None. Undecodable messages are skipped."""
    try:
        data = sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None
    try:
        return decode_msg(data)
    except Exception:  # a malformed frame must not kill the loop; msgpack never executes code
        return None


def recv_all_nowait(sock: zmq.Socket) -> list[Msg]:
    """Every message waiting on the socket, in order; undecodable ones are skipped."""
    out = []
    while True:
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return out
        try:
            out.append(decode_msg(data))
        except Exception:
            continue
