"""The scheduler's end of SubmitLink: many requests over one stream (the router's link to the pool).

Each submission on the stream is served by its own task exactly as a Submit call is (the same
`serve` generator: intake, admission, chunks, errors); what changes is the transport. Their
chunks and errors are gathered and sent several to a message: after a step, every stream's chunk
is put on its request's queue in one turn of the loop, each request's task forwards its chunk in
the next, and the writer, woken by the first of them, runs after all of them, so a step's tokens
for all the link's requests leave in one message rather than one gRPC write per stream. A cancel
for a request (its client went away) cancels its task, as a cancelled Submit call would; when
the stream ends, every request still on it is cancelled.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

from services.common.errors import ErrorKind, ServiceError
from services.common.grpc_errors import grpc_status
from services.common.proto.qos.v1 import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)

# (submission, W3C traceparent) -> the request's chunks; raises ServiceError as Submit would.
Serve = Callable[[scheduler_pb2.SubmitRequest, str], AsyncIterator[common_pb2.GenerateChunk]]

# Events per reply message: a reply stays well under the channel's message size limit even when
# every one is a final chunk carrying a whole held-back answer.
MAX_EVENTS_PER_REPLY = 256


def link_error(error: ServiceError) -> scheduler_pb2.LinkError:
    """An error as Submit's call would end with it (status, message, trailing metadata)."""
    return scheduler_pb2.LinkError(status=grpc_status(error.kind).name, message=error.message,
                                   trailers=dict(error.trailers()))


class LinkSession:
    """One SubmitLink stream: its requests' tasks and the events waiting to be sent."""

    def __init__(self, serve: Serve):
        self._serve = serve
        self._tasks: dict[int, asyncio.Task] = {}
        self._replies: deque[scheduler_pb2.LinkReply] = deque()   # filled as events come, sent by replies()
        self._wake = asyncio.Event()
        self._reading = True

    @property
    def requests(self) -> int:
        """Requests on the stream now."""
        return len(self._tasks)

    async def replies(self, requests: AsyncIterator[scheduler_pb2.LinkRequest]
                      ) -> AsyncIterator[scheduler_pb2.LinkReply]:
        """The stream's replies, until the router has closed its side and every request ended."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while self._reading or self._tasks or self._replies:
                await self._wake.wait()
                self._wake.clear()
                while self._replies:
                    yield self._replies.popleft()
            await reader        # its error, if reading failed
        finally:
            reader.cancel()
            for task in list(self._tasks.values()):
                task.cancel()

    async def _read(self, requests: AsyncIterator[scheduler_pb2.LinkRequest]) -> None:
        try:
            async for message in requests:
                # Submissions first: a cancel may be for a request submitted in the same message.
                for item in message.submits:
                    if item.key in self._tasks:
                        self._send_error(item.key, ServiceError(
                            ErrorKind.INVALID, f"link key {item.key} is already in use on this stream",
                            field="key", reason="invalid_argument"))
                        continue
                    task = asyncio.create_task(self._run(item.key, item.submit, item.traceparent))
                    self._tasks[item.key] = task
                    # Not in _run's finally: a task cancelled before it starts never runs its body.
                    task.add_done_callback(lambda _, key=item.key: self._ended(key))
                for key in message.cancels:
                    task = self._tasks.get(key)
                    if task is not None:
                        task.cancel()
        finally:
            self._reading = False
            self._wake.set()

    async def _run(self, key: int, submit: scheduler_pb2.SubmitRequest, traceparent: str) -> None:
        try:
            async for chunk in self._serve(submit, traceparent):
                self._event(key).chunk.CopyFrom(chunk)
        except ServiceError as error:
            self._send_error(key, error)
        except asyncio.CancelledError:
            pass            # the router cancelled it or the stream ended: nobody to tell
        except Exception:   # a bug must not take the other requests on the stream down with it
            log.exception("request %s on a link stream failed", submit.request_id)
            self._send_error(key, ServiceError(ErrorKind.INTERNAL, "the scheduler failed serving this "
                                               "request (see its log)", reason="internal"))

    def _ended(self, key: int) -> None:
        del self._tasks[key]
        self._wake.set()

    def _send_error(self, key: int, error: ServiceError) -> None:
        self._event(key).error.CopyFrom(link_error(error))

    def _event(self, key: int) -> scheduler_pb2.LinkEvent:
        """A new event of request `key`, in the reply being filled (copied into it once, not into an
        event and again into the reply), for replies() to send."""
        if not self._replies or len(self._replies[-1].events) >= MAX_EVENTS_PER_REPLY:
            self._replies.append(scheduler_pb2.LinkReply())
        self._wake.set()
        return self._replies[-1].events.add(key=key)
