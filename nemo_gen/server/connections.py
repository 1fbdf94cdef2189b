"""The bound on a connection's request headers: ``header_deadline``, uvicorn's HTTP protocol with a
deadline on the headers of each request.

uvicorn bounds a connection only between requests (``timeout_keep_alive``, armed once an answer
is sent), and neither of its HTTP parsers has a header-read timeout: a connection that opens and
sends nothing, or half a header, is kept for as long as its peer likes. Here a timer starts when
a connection opens, and again at the first byte of each later request, and is cancelled once the
request's headers are whole (uvicorn has then made the request's cycle); when it fires, the
connection is closed. What comes after the headers — the body, the answer — is the routes' to
bound (``server.max_body_bytes``, the request's deadline).

Owns: the header timer of each connection of the server.
"""

from __future__ import annotations

import asyncio
from typing import Any


def header_deadline(base: type[asyncio.Protocol], timeout_s: float) -> type[asyncio.Protocol]:
    """``base`` (uvicorn's httptools or h11 protocol) with its request headers due within
    ``timeout_s`` seconds."""

    class HeaderDeadline(base):  # type: ignore[valid-type, misc]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if self._header_timer is None and (cycle is None or cycle.response_complete):
                self._arm()  # the first byte of a new request: its headers are due
            super().data_received(data)
            if self.cycle is not cycle:  # the request's headers are whole
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return  # a request is being answered; its successor's bytes came early (pipelined)
            if not self.transport.is_closing():
                self.transport.close()

    HeaderDeadline.__name__ = HeaderDeadline.__qualname__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadline
