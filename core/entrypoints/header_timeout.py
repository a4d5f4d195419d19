"""A header-read timeout for uvicorn's h11 protocol: a connection must finish a request's headers
within `HEADER_TIMEOUT_S` of opening (or of its previous response), else it is closed.

uvicorn bounds idle keep-alive connections but not a client that sends its headers a byte at a time
(slowloris): any byte cancels the keep-alive timer, and h11 waits for the rest forever, holding a
socket and a protocol object. Here a timer is armed when a connection opens and after each response;
when it fires, if no new request cycle began (h11 makes one when the headers are complete), the
transport is closed. A request whose headers arrived is never touched: its body and its response
take as long as they take.
"""

from __future__ import annotations

import os

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = float(os.environ.get("WORKBENCH_HEADER_TIMEOUT_S", "15"))


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header-read timeout above (pass as `uvicorn.Config(http=...)`)."""

    header_timeout_s = HEADER_TIMEOUT_S

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
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        handle = getattr(self, "_header_timer", None)
        if handle is not None:
            handle.cancel()
        super().connection_lost(exc)
