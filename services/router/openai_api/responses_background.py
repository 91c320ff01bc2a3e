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
(responses_kept.py, services/store/response_store.py) - unless another router runs it again:
every router looks every third of the lease for a background response (not streamed) whose lease
lapsed, claims it (one claim wins) and runs it again from its body, as its tenant, in its class,
under its request id (billed once: the ledger's one row per request id), at most MAX_RUNS runs
in all. A refusal that a foreground request gets
as its HTTP status (a rate limit, the budget, a class not allowed) ends a background one
`failed` with the same code and message.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace

from starlette.responses import JSONResponse, Response, StreamingResponse

from services.common.errors import ServiceError, invalid
from services.common.priority import MAX_STREAM_INTERVAL, PRIORITY_HEADER, priority_name
from services.control.tenancy import Caller
from services.router.openai_api.generation import answer_object, choice_chunks
from services.router.openai_api.request import OpenAIRequest
from services.router.openai_api.responses_stream import EventLog, stored_tail
from services.router.validation import RequestHead
from services.store.response_store import ACTIVE, ResponseStore
from services.store.store import Tenant

log = logging.getLogger(__name__)

STOPPED = "the router running this background response stopped before it ended: send the request again"


class BackgroundResponses:
    def __init__(self, front, store: ResponseStore, config, replica: str):
        self.front, self.store, self.config, self.replica = front, store, config, replica
        self.running: dict[str, asyncio.Task] = {}
        self.logs: dict[str, EventLog] = {}       # the running streamed ones' events
        self.renewing: asyncio.Task | None = None
        self.adopting: asyncio.Task | None = None
        self.stopping = False

    def begin(self) -> None:
        """Look for background responses whose router was lost, to run them again here."""
        self.adopting = asyncio.create_task(self._adopt())

    async def start(self, head: RequestHead, caller: Caller, request: OpenAIRequest, headers: dict) -> Response:
        """The response, queued (kept before it is answered, so a poll finds it at once); made
        with stream, its events as they come instead."""
        self.front.drain.enter()           # refused while draining; the drain waits for it below
        try:
            out = answer_object(request, head)
            queued = out.response("queued")
            now = time.time()
            # what runs it again elsewhere if this router is lost (a stream is not: its events are out)
            again = None if request.stream else {"body": request.responses.body, "key_prefix": caller.key_prefix,
                                                 "priority": priority_name(head.priority), "runs": 1}
            await asyncio.to_thread(self.store.add, caller.name, queued, request.responses.items, now,
                                    now + self.config.retention_s, self.replica,
                                    now + self.config.background_lease_s, again)
            events = None
            if request.stream:
                events = self.logs[out.id] = EventLog(out.id)
                events.extend(out.queued())
                await events.store(self.store, everything=True)
        except BaseException:
            self.front.drain.leave()
            raise
        self._launch(out, head, caller, request, events)
        if events is None:
            return JSONResponse(queued, headers=headers)
        return StreamingResponse(events.tail(-1), media_type="text/event-stream", headers=headers)

    def _launch(self, out, head: RequestHead, caller: Caller, request: OpenAIRequest, events: EventLog | None):
        self.running[out.id] = asyncio.create_task(self._run(out, head, caller, request, events))
        if self.renewing is None or self.renewing.done():
            self.renewing = asyncio.create_task(self._renew())

    async def _adopt(self) -> None:
        """Every third of the lease: a background response whose router was lost, claimed and run
        again here (one at a time; none while this router drains)."""
        while not self.stopping:
            await asyncio.sleep(self.config.background_lease_s / 3)
            if self.front.drain.draining:
                continue
            try:
                found = await asyncio.to_thread(self.store.adopt, self.replica, time.time(),
                                                self.config.background_lease_s)
                if found is not None:
                    await self._run_again(found)
            except Exception:            # looked for again at the next
                log.exception("could not take over a background response")

    async def _run_again(self, found: dict) -> None:
        """A claimed response run again from its body, as its tenant, under its request id."""
        sent = found["request"]
        caller = Caller(self.front.book.tenants.get(found["tenant"], Tenant(found["tenant"])), sent["key_prefix"])
        log.info("running background response %s again (run %d): its router was lost", found["id"], sent["runs"])
        try:
            request = await self.front.kept_responses.parse(json.dumps(sent["body"]).encode(), caller)
            head = replace(self.front.router.let_in({PRIORITY_HEADER: sent["priority"]}, caller),
                           request_id=found["id"].removeprefix("resp_"), stream_interval=MAX_STREAM_INTERVAL)
            self.front.drain.enter()
        except ServiceError as error:         # (a previous response deleted since, the tenant's storage full)
            current = await asyncio.to_thread(self.store.current, found["id"], time.time())
            if current is not None:
                await self._write({**current, "status": "failed", "error": {"code": error.reason or "server_error",
                                                                            "message": error.message}})
            return
        out = answer_object(request, head)
        out.created = int(found["created_at"])
        self._launch(out, head, caller, request, None)

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
        for task in (self.renewing, self.adopting):
            if task is not None:
                task.cancel()
