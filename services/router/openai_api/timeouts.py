"""The HTTP front's read timeout: a client that stops sending is let go.

uvicorn times out a kept-alive connection idle between requests, but not one that connects and
sends nothing, nor one that stops in the middle of its headers: each such connection was held
for ever (three sockets were still open after 90 s), so enough slow clients would take the
router's connections and file handles. `ReadTimeoutProtocol` gives a request's headers
[router] http_read_timeout_s from the connection's opening, or from the first byte after the
previous response; past it the client gets 408 and the connection is closed. Any bytes while no
request is being answered arm it (uvicorn's own keep-alive timer is cancelled by any byte, a
bare CRLF included). The body's pieces are held to the same time each (body.py): a 408
in OpenAI's error shape, with `connection: close`.
"""
from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

TIMEOUT_BODY = json.dumps({"error": {
    "message": "the request's headers did not arrive in time: send the whole request without pauses",
    "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()


def read_timeout_protocol(timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline on each request's headers."""

    class ReadTimeoutProtocol(HttpToolsProtocol):
        _headers_timer: asyncio.TimerHandle | None = None
        _started = False            # some bytes of the current request have arrived

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._answering() and self._headers_timer is None and not self.transport.is_closing():
                self._arm()         # bytes between requests (a pipelined request, a stray CRLF)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._started = True
            if self._headers_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            self._started = False
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _answering(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._headers_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _headers_late(self) -> None:
            self._headers_timer = None
            if self.transport.is_closing():
                return
            if self._answering():   # a request before this one is still being answered: look again then
                self._arm()
                return
            if self._started:       # part of a request came: say why it is closed
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                                     % (len(TIMEOUT_BODY), TIMEOUT_BODY))
            self.transport.close()

    return ReadTimeoutProtocol
