"""Read timeouts and half-closes for uvicorn's h11 protocol.

- Headers: a connection must finish a request's headers within `HEADER_TIMEOUT_S` of opening (or of
  its previous response), else it is closed. uvicorn bounds idle keep-alive connections but not a
  client that sends its headers a byte at a time (slowloris): any byte cancels the keep-alive timer,
  and h11 waits for the rest forever, holding a socket and a protocol object.
- Body: once the headers are in, the whole body must arrive within `BODY_TIMEOUT_S`, else the client
  gets a 408 in the OpenAI error envelope and the connection is closed (a `Content-Length: 1000`
  followed by 14 bytes would otherwise hold a socket, and a handler waiting on it, forever).
  A request whose body arrived is never touched: its response takes as long as it takes.
- Half-close: a client may shut down its sending side once its request is sent (`nc -N`, some
  proxies); it still gets its response. asyncio would close the transport on that EOF, which looks
  like a disconnect and aborts the request. Here the transport stays open while a request is being
  answered; since a half-close and a client that went away look the same until something is
  written, the server writes an interim `102 Processing` (a 1xx every HTTP/1.1 client skips) and
  watches the socket (Linux `TCP_INFO`): a client that is gone answers it with a reset, and its
  request is then aborted as before. The connection closes after the response.
"""

from __future__ import annotations

import json
import os
import socket
import struct

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = float(os.environ.get("WORKBENCH_HEADER_TIMEOUT_S", "15"))
BODY_TIMEOUT_S = float(os.environ.get("WORKBENCH_BODY_TIMEOUT_S", "60"))
_PROBE_S = 0.5  # after a half-close: how often the socket is checked for a reset
_TCP_CLOSE = 7  # tcp_states.h: the state a reset leaves a socket in

_TIMEOUT_BODY = json.dumps(
    {
        "error": {
            "message": f"The request body did not arrive within {BODY_TIMEOUT_S:g} s; send it again.",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_timeout",
        }
    }
).encode()


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the timeouts and half-close handling above (pass as
    `uvicorn.Config(http=...)`)."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    # ---- headers

    def _arm_header_timer(self) -> None:
        armed_for = self.cycle
        handle = getattr(self, "_header_timer", None)
        if handle is not None:
            handle.cancel()

        def expire() -> None:
            if self.cycle is armed_for and not self.transport.is_closing():
                self.transport.close()  # no complete request headers in time

        self._header_timer = self.loop.call_later(self.header_timeout_s, expire)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer_eof = False
        self._body_timer = None
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._peer_eof:  # the client sends nothing more: the connection is done
            self.transport.close()
        elif not self.transport.is_closing():
            self._arm_header_timer()

    # ---- body

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not before and cycle.more_body and not self.transport.is_closing():
            if self._body_timer is not None:
                self._body_timer.cancel()
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_expired, cycle)

    def _body_expired(self, cycle) -> None:
        if cycle is not self.cycle or not cycle.more_body or self.transport.is_closing():
            return
        if not cycle.response_started:
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY
            )
        self.transport.close()  # the handler waiting for the body sees a disconnect

    # ---- half-close

    def eof_received(self) -> bool | None:  # type: ignore[override]
        cycle = self.cycle
        answering = cycle is not None and not cycle.response_complete and not cycle.more_body
        if not answering or self.conn.our_state is not h11.SEND_RESPONSE:
            return None  # nothing being answered (or a body cut short): close, as asyncio does
        self._peer_eof = True
        if not cycle.response_started:
            self.transport.write(
                self.conn.send(h11.InformationalResponse(status_code=102, headers=[], reason=b"Processing"))
            )
        self.loop.call_later(_PROBE_S, self._probe, cycle)
        return True  # keep the transport open for the response

    def _probe(self, cycle) -> None:
        if cycle is not self.cycle or cycle.response_complete or self.transport.is_closing():
            return
        if _peer_reset(self.transport):
            self.transport.close()  # connection_lost: the request is aborted as for any disconnect
            return
        self.loop.call_later(_PROBE_S, self._probe, cycle)

    def connection_lost(self, exc) -> None:
        for name in ("_header_timer", "_body_timer"):
            handle = getattr(self, name, None)
            if handle is not None:
                handle.cancel()
        super().connection_lost(exc)


def _peer_reset(transport) -> bool:
    """True when the socket was reset by the peer (Linux; elsewhere never known, so False)."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return False
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
    except OSError:
        return True
    return struct.unpack("B", info[:1])[0] == _TCP_CLOSE
