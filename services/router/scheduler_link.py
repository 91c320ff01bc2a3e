"""The router's link to one pool's scheduler: every request to that pool over one long-lived
SubmitLink stream, instead of a Submit call each.

A gRPC call per request cost the router and the scheduler 0.3-0.6 ms more CPU a request each, and
more a chunk, than an entry on one stream (bench/control_plane_cpu.py); in a burst of 800
requests a second those calls were much of what the two did in that second (docs/performance.md).
On the link a request is one entry in a message, submissions gathered per turn of the event loop,
and the scheduler sends each step's chunks for all the link's requests in one message. Each request
still gets its own chunks and errors, exactly as its Submit call would have given them (the same
ServiceErrors, retry-after included).

When the stream breaks (the scheduler died or restarted) every request on it fails with the
error its call would have (UNAVAILABLE, naming the scheduler), and the router moves them as
before; the next request opens a new stream. A scheduler that does not know SubmitLink (an older
version, during a rolling upgrade) answers UNIMPLEMENTED: the link then says so once
(LinkUnsupported) and the router uses Submit calls for that pool from then on.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import grpc

from services.common.errors import ErrorKind, ServiceError, unavailable
from services.common.grpc_errors import error_from_rpc, error_from_status
from services.common.proto.qos.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


class LinkUnsupported(Exception):
    """The scheduler has no SubmitLink: nothing was sent for the request; use a Submit call."""


class LinkCall:
    """One request on the link: iterate for its chunks (ServiceError when it fails); cancel() when
    the consumer stops before its last chunk."""
    __slots__ = ("key", "_stream", "_events", "ended")

    def __init__(self, key: int, stream: _LinkStream):
        self.key = key
        self._stream = stream
        self._events: asyncio.Queue = asyncio.Queue()
        self.ended = False

    def deliver(self, event: common_pb2.GenerateChunk | Exception) -> None:
        self._events.put_nowait(event)

    async def __aiter__(self) -> AsyncIterator[common_pb2.GenerateChunk]:
        while True:
            event = await self._events.get()
            if isinstance(event, Exception):
                self.ended = True
                raise event
            yield event
            if event.finish_reason:
                self.ended = True
                return

    def cancel(self) -> None:
        if not self.ended:
            self.ended = True
            self._stream.cancel(self.key)


class _LinkStream:
    """One SubmitLink call and the requests on it."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, peer: str, metadata=()):
        self.peer = peer
        self.calls: dict[int, LinkCall] = {}
        self.broken = False
        self.unsupported = False
        self._written = 0                 # messages handed to gRPC to write
        self._answered = False            # a reply came on this stream
        self._keys = itertools.count(1)
        self._outgoing = scheduler_pb2.LinkRequest()    # gathered until the writer's next turn
        self._wake = asyncio.Event()
        self._call = stub.SubmitLink(self._requests(), metadata=metadata)
        self._reader = asyncio.create_task(self._read())

    def submit(self, submit: scheduler_pb2.SubmitRequest, traceparent: str) -> LinkCall:
        call = LinkCall(next(self._keys), self)
        self.calls[call.key] = call
        self._outgoing.submits.add(key=call.key, submit=submit, traceparent=traceparent)
        self._wake.set()
        return call

    def cancel(self, key: int) -> None:
        if self.calls.pop(key, None) is not None and not self.broken:
            self._outgoing.cancels.append(key)
            self._wake.set()

    def close(self) -> None:
        self._call.cancel()

    async def _requests(self) -> AsyncIterator[scheduler_pb2.LinkRequest]:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._outgoing.submits or self._outgoing.cancels:
                message, self._outgoing = self._outgoing, scheduler_pb2.LinkRequest()
                self._written += 1
                yield message

    async def _read(self) -> None:
        error: Exception = unavailable(f"{self.peer}: the link stream ended", reason="truncated")
        try:
            async for reply in self._call:
                self._answered = True
                calls = self.calls
                for event in reply.events:
                    call = calls.get(event.key)
                    if call is None:            # cancelled meanwhile
                        continue
                    if event.HasField("error"):
                        del calls[event.key]
                        sent = event.error
                        call.deliver(error_from_status(sent.status, sent.message, dict(sent.trailers), self.peer))
                        continue
                    chunk = event.chunk
                    if chunk.finish_reason:
                        del calls[event.key]
                    call.deliver(chunk)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.unsupported = True
                log.warning("%s has no SubmitLink (an older scheduler?): a Submit call per request to it "
                            "from now on", self.peer)
                error = LinkUnsupported(f"{self.peer}: no SubmitLink ({exc.details()})")
            elif self._status_lost(exc):
                # Nothing reached the scheduler: its requests go as Submit calls, which get its real
                # answer; the next request tries the link again.
                log.info("%s ended the link before taking its first message (its status lost to gRPC): "
                         "those requests go as Submit calls", self.peer)
                error = LinkUnsupported(f"{self.peer}: the link ended before its first message was taken")
            else:
                error = error_from_rpc(exc, self.peer)
        except asyncio.CancelledError:
            error = ServiceError(ErrorKind.CANCELLED, f"{self.peer}: the router closed its link")
            raise
        finally:
            self.broken = True
            calls, self.calls = self.calls, {}
            for call in calls.values():
                call.deliver(error)


    def _status_lost(self, exc: grpc.aio.AioRpcError) -> bool:
        """gRPC's asyncio client replaces the server's status with INTERNAL "Internal error from
        Core" when a write fails because that status has just arrived (grpc/grpc#36066): an older
        scheduler's UNIMPLEMENTED reads so about 1 time in 75 (measured with the stand-in). When the
        stream got no reply and gRPC was given one message, the failed write was that message, so
        nothing reached the scheduler and its requests may go again."""
        return (exc.code() == grpc.StatusCode.INTERNAL and exc.details() == "Internal error from Core"
                and not self._answered and self._written <= 1)


class SchedulerLink:
    """The pool's current link stream, opened when a request needs it (again, after a break)."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, peer: str, metadata=()):
        self._stub = stub
        self._peer = peer
        self._metadata = metadata           # the cluster token (services/common/cluster_auth.py)
        self._stream: _LinkStream | None = None

    @property
    def unsupported(self) -> bool:
        """The scheduler answered UNIMPLEMENTED: Submit calls for this pool from now on."""
        return self._stream is not None and self._stream.unsupported

    @property
    def requests(self) -> int:
        """Requests on the link now."""
        return len(self._stream.calls) if self._stream is not None else 0

    def submit(self, submit: scheduler_pb2.SubmitRequest, traceparent: str) -> LinkCall:
        """Send the request on the link; raises LinkUnsupported where the scheduler has none."""
        stream = self._stream
        if self.unsupported:
            raise LinkUnsupported(self._peer)
        if stream is None or stream.broken:
            stream = self._stream = _LinkStream(self._stub, self._peer, self._metadata)
        return stream.submit(submit, traceparent)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
