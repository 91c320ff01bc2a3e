"""Background responses (`background: true` on POST /v1/responses): answered at once with the
response `queued`, then run by this router as any request is (its tenant's class, limits and
bill; the shared request path, failover included), kept in the store as it goes: `in_progress`
at its first token, then as it ended. The client polls GET /v1/responses/{id}; POST .../cancel
ends it `cancelled` from any replica.

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

from services.common.errors import ServiceError
from services.control.tenancy import Caller
from services.router.openai_api.generation import answer_object, choice_chunks
from services.router.openai_api.request import OpenAIRequest
from services.router.validation import RequestHead
from services.store.response_store import ACTIVE, ResponseStore

log = logging.getLogger(__name__)

STOPPED = "the router running this background response stopped before it ended: send the request again"


class BackgroundResponses:
    def __init__(self, front, store: ResponseStore, config, replica: str):
        self.front, self.store, self.config, self.replica = front, store, config, replica
        self.running: dict[str, asyncio.Task] = {}
        self.renewing: asyncio.Task | None = None
        self.stopping = False

    async def start(self, head: RequestHead, caller: Caller, request: OpenAIRequest) -> dict:
        """The response, queued (kept before it is answered, so a poll finds it at once)."""
        self.front.drain.enter()           # refused while draining; the drain waits for it below
        try:
            out = answer_object(request, head)
            queued = out.response("queued")
            now = time.time()
            await asyncio.to_thread(self.store.add, caller.name, queued, request.responses.items, now,
                                    now + self.config.retention_s, self.replica,
                                    now + self.config.background_lease_s)
        except BaseException:
            self.front.drain.leave()
            raise
        self.running[out.id] = asyncio.create_task(self._run(out, head, caller, request))
        if self.renewing is None or self.renewing.done():
            self.renewing = asyncio.create_task(self._renew())
        return queued

    async def _run(self, out, head: RequestHead, caller: Caller, request: OpenAIRequest) -> None:
        chunks = choice_chunks(self.front.path, head, caller, request, None)
        try:
            ended = await self._answer(out, chunks)
        except asyncio.CancelledError:
            # The router stops; or a cancel (when its row says so already, this write changes nothing).
            ended = out.response("failed", error={"code": "server_error", "message": STOPPED}) if self.stopping \
                else out.response("cancelled")
        finally:
            with contextlib.suppress(BaseException):
                await chunks.aclose()       # the relay cancels the scheduler's call
            self.running.pop(out.id, None)
            self.front.drain.leave()
        if ended is not None:
            await self._write(ended)
            await self.front.kept_responses.join(caller, out)

    async def _answer(self, out, chunks) -> dict:
        started = False
        try:
            async for index, chunk in chunks:
                if not started:
                    started = True
                    await self._write(out.response("in_progress"))
                out.add(index, chunk)
                if out.finished:
                    break
        except ServiceError as error:
            return out.response("failed", error={"code": error.reason or "server_error", "message": error.message})
        return out.body()

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
