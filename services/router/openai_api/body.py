"""A request body read within the HTTP front's limits: its size ([router] http_max_body_bytes, a
413) and the time between its pieces ([router] http_read_timeout_s, a 408).

Why a 413 reads the rest of the body first: a client that has not finished sending must still
read the answer. uvicorn closes a connection that is not kept alive (HTTP/1.0, `connection:
close`) as soon as the answer is written, and a socket closed with bytes unread makes the kernel
send a reset: the client, still writing, gets "connection reset" and never sees the 413 (a
512 KiB body against a 64 KiB limit, sent in two pieces, was reset every time). So the front reads
and drops what is left, as nginx's lingering close does, within bounds: up to DRAIN_FACTOR times
the limit in all and the read timeout in all. A body declared larger than that, or one whose
client waits for `100 Continue` before sending it, is answered at once.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.requests import Request

from services.common.errors import ErrorKind, ServiceError

DRAIN_FACTOR = 4        # a body of up to 4x the limit is read to its end before the 413


async def read_body(http: Request, limit: int, wait_s: float) -> bytes:
    """The whole body; PAYLOAD_TOO_LARGE past `limit` bytes, REQUEST_TIMEOUT when a piece takes
    longer than `wait_s` to come."""
    too_large = ServiceError(ErrorKind.PAYLOAD_TOO_LARGE, f"the request body is over the limit of {limit} "
                             "bytes (router.http_max_body_bytes)", field="body", reason="body_too_large")
    length = http.headers.get("content-length", "")
    declared = int(length) if length.isdigit() else None
    pieces = http.stream()
    if declared is not None and declared > limit:
        if declared <= DRAIN_FACTOR * limit and "100-continue" not in http.headers.get("expect", "").lower():
            await _drop_rest(pieces, 0, DRAIN_FACTOR * limit, time.monotonic() + wait_s)
        raise too_large
    body = bytearray()
    while (piece := await _next_piece(pieces, wait_s)) is not None:
        body += piece
        if len(body) > limit:       # sent without a length (chunked), or longer than it said
            await _drop_rest(pieces, len(body), DRAIN_FACTOR * limit, time.monotonic() + wait_s)
            raise too_large
    return bytes(body)


async def _next_piece(pieces: AsyncIterator[bytes], wait_s: float) -> bytes | None:
    """The body's next piece (None at its end), within the read timeout."""
    try:
        return await asyncio.wait_for(anext(pieces, None), wait_s)
    except asyncio.TimeoutError:
        raise ServiceError(ErrorKind.REQUEST_TIMEOUT, f"the request body stopped arriving for {wait_s:g} s "
                           "(router.http_read_timeout_s): send it without pauses", field="body",
                           reason="body_timeout") from None


async def _drop_rest(pieces: AsyncIterator[bytes], received: int, most: int, deadline: float) -> None:
    """Reads and drops the body's remaining pieces until its end, `most` bytes in all, or the
    deadline, whichever comes first; a client that stops sending only ends it sooner."""
    while received <= most and (left := deadline - time.monotonic()) > 0:
        try:
            piece = await asyncio.wait_for(anext(pieces, None), left)
        except Exception:       # a timeout, the client gone: the 413 is the answer either way
            return
        if piece is None:
            return
        received += len(piece)
