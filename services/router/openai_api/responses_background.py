"""Background responses (`background: true` on POST /v1/responses): answered at once with the
response `queued`, then run by this router as any request is (its tenant's class, limits and
bill; the shared request path, failover included), kept in the store as it goes: `in_progress`
at its first token, then as it ended. The client polls GET /v1/responses/{id}; POST .../cancel
ends it `cancelled` from any replica. Made with `stream: true`, its events go to the client as
they come and are kept for a client resuming it (responses_stream.py).

Who runs it: the router that took it, which holds a lease on its row and renews it every third of
`[responses] background_lease_s`, reading each of its responses' status as it does (so a cancel
made on another replica stops it within that time). A router that drains lets its background
responses finish within its drain time, then ends the rest `failed` (saying to send again); one
that is lost ends nothing, and the first read after its lease lapses ends them `failed`
(responses_kept.py, services/store/response_store.py). A refusal that a foreground request gets
as its HTTP status (a rate limit, the budget, a class not allowed) ends a background one
`failed` with the same code and message.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from starlette.responses import JSONResponse, Response, StreamingResponse

from services.common.errors import ServiceError, invalid
from services.control.tenancy import Caller
from services.router.openai_api.generation import answer_object, choice_chunks
from services.router.openai_api.request import OpenAIRequest
from services.router.openai_api.responses_stream import EventLog, stored_tail
from services.router.validation import RequestHead
from services.store.response_store import ACTIVE, ResponseStore

log = logging.getLogger(__name__)

STOPPED = "the router running this background response stopped before it ended: send the request again"


class BackgroundResponses:
    def __init__(self, front, store: ResponseStore, config, replica: str):
        self.front, self.store, self.config, self.replica = front, store, config, replica
        self.running: dict[str, asyncio.Task] = {}
        self.logs: dict[str, EventLog] = {}       # the running streamed ones' events
        self.renewing: asyncio.Task | None = None
        self.stopping = False

    async def start(self, head: RequestHead, caller: Caller, request: OpenAIRequest, headers: dict) -> Response:
        """The response, queued (kept before it is answered, so a poll finds it at once); made
        with stream, its events as they come instead."""
        self.front.drain.enter()           # refused while draining; the drain waits for it below
        try:
            out = answer_object(request, head)
            queued = out.response("queued")
            now = time.time()
            await asyncio.to_thread(self.store.add, caller.name, queued, request.responses.items, now,
                                    now + self.config.retention_s, self.replica,
                                    now + self.config.background_lease_s)
            events = None
            if request.stream:
                events = self.logs[out.id] = EventLog(out.id)
                events.extend(out.queued())
                await events.store(self.store, everything=True)
        except BaseException:
            self.front.drain.leave()
            raise
        self.running[out.id] = asyncio.create_task(self._run(out, head, caller, request, events))
        if self.renewing is None or self.renewing.done():
            self.renewing = asyncio.create_task(self._renew())
        if events is None:
            return JSONResponse(queued, headers=headers)
        return StreamingResponse(events.tail(-1), media_type="text/event-stream", headers=headers)

    async def _run(self, out, head: RequestHead, caller: Caller, request: OpenAIRequest,
                   events: EventLog | None) -> None:
        chunks = choice_chunks(self.front.path, head, caller, request, None)
        try:
            ended = await self._answer(out, chunks, events)
        except asyncio.CancelledError:
            # The router stops; or a cancel (when its row says so already, this write changes nothing).
            ended = out.response("failed", error={"code": "server_error", "message": STOPPED}) if self.stopping \
                else out.response("cancelled")
        finally:
            with contextlib.suppress(BaseException):
                await chunks.aclose()       # the relay cancels the scheduler's call
            self.running.pop(out.id, None)
            self.front.drain.leave()
        if events is not None:              # every event in the store before its last status
            if not events.ended and ended is not None:
                events.extend(out.ended_events(ended))
            await events.store(self.store, everything=True)
            events.close()
            self.logs.pop(out.id, None)
        if ended is not None:
            await self._write(ended)
            await self.front.kept_responses.join(caller, out)

    async def _answer(self, out, chunks, events: EventLog | None) -> dict:
        started = False
        try:
            async for index, chunk in chunks:
                if not started:
                    started = True
                    await self._write(out.response("in_progress"))
                if events is None:
                    out.add(index, chunk)
                else:
                    events.extend(out.events(index, chunk))
                    await events.store(self.store)
                if out.finished:
                    break
        except ServiceError as error:
            failed = {"code": error.reason or "server_error", "message": error.message}
            if events is not None:
                events.extend(out.failed_events(error, None))
            return out.response("failed", error=failed)
        return out.body() if events is None else out.final

    async def stream_again(self, response: dict, after: int) -> Response:
        """GET /v1/responses/{id}?stream=true: its events after `after`, from here when it runs
        here, else from the store."""
        running = self.logs.get(response["id"])
        if running is not None:
            return StreamingResponse(running.tail(after), media_type="text/event-stream")
        if await asyncio.to_thread(self.store.last_event, response["id"]) is None:
            raise invalid(f"stream: response {response['id']!r} was not made in the background with stream true "
                          "(or its events are no longer kept): GET it without stream", "stream")
        return StreamingResponse(stored_tail(self.store, response["id"], after), media_type="text/event-stream")

    async def _write(self, response: dict) -> None:
        try:
            if not await asyncio.to_thread(self.store.update, response, self.replica):
                log.info("background response %s was no longer running here (cancelled or lost)", response["id"])
        except Exception:       # its lease lapses and a reader ends it failed
            log.exception("could not write background response %s", response["id"])

    async def _renew(self) -> None:
        """The leases of the running responses, while there are any; a cancel seen stops its run."""
        while self.running:
            await asyncio.sleep(self.config.background_lease_s / 3)
            try:
                statuses = await asyncio.to_thread(self.store.renew, self.replica, list(self.running), time.time(),
                                                   self.config.background_lease_s)
            except Exception as exc:
                log.warning("could not renew background responses' leases (%s)", exc)
                continue
            for response_id, status in statuses.items():
                if status not in ACTIVE and response_id in self.running:
                    self.running[response_id].cancel()

    def cancel_here(self, response_id: str) -> None:
        """A cancel took effect in the store: stop the run now if it is this router's."""
        if response_id in self.running:
            self.running[response_id].cancel()

    async def stop(self) -> None:
        """After the drain: what still runs ends failed, saying to send again."""
        self.stopping = True
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.renewing is not None:
            self.renewing.cancel()
