"""Kept Responses API answers on the HTTP front: what `store: true` (OpenAI's default) is for.

    GET    /v1/responses/{id}                  the response object as it was answered; with
                                               stream=true[&starting_after=N], a background
                                               stream's events (responses_stream.py)
    GET    /v1/responses/{id}/input_items      its conversation's input items (earlier turns' too),
                                               a page at a time (after, limit 1-100, order)
    DELETE /v1/responses/{id}
    POST   /v1/responses/{id}/cancel           a background response, queued or running, ends
                                               cancelled (responses_background.py runs them)
    POST   /v1/responses  previous_response_id continues a kept response (responses_request.py)

An answer is kept when it ends (completed, incomplete, or failed after its stream began), before
its last event or its body goes out, so the next turn can name it at once. Each is its tenant's
(the caller's key; with auth off, x-tenant): to another tenant it is an id that does not exist,
to GET, DELETE and previous_response_id alike; the admin key sees every tenant's. Kept
`[responses] retention_s`, then deleted. A store that cannot take it leaves the answer unkept
(logged, counted in qos_responses_kept_total{outcome="failed"}); the answer still goes out.
"""
from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Counter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.common.errors import ErrorKind, ServiceError, invalid
from services.common.responses_config import ResponsesConfig
from services.control.storage_quota import require_room
from services.control.tenancy import Caller
from services.router.openai_api.generation import error_response
from services.router.openai_api.item_pages import item_page, page_query
from services.router.openai_api.request import OpenAIRequest, json_object
from services.router.openai_api.responses_background import BackgroundResponses
from services.router.openai_api.responses_request import conversation_id, parse_responses_body, previous_id
from services.store.response_store import ACTIVE, ResponseStore

log = logging.getLogger(__name__)

PURGE_EVERY_S = 60.0       # expired rows are deleted at most this often (reads never see them anyway)


class KeptResponses:
    def __init__(self, front, store: ResponseStore, config: ResponsesConfig, registry, replica: str,
                 conversations=None):
        self.front, self.store, self.config, self.conversations = front, store, config, conversations
        self.background = BackgroundResponses(front, store, config, replica)
        self.purged = 0.0
        self.outcomes = Counter("qos_responses_kept", "Responses API answers asked to be kept (store: true), by "
                                "outcome (kept; failed: the store refused them)", ("outcome",), registry=registry)

    def routes(self) -> list[Route]:
        return [Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
                Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"]),
                Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"])]


    async def parse(self, raw: bytes, caller: Caller) -> OpenAIRequest:
        """A POST /v1/responses body, with the kept response it continues read from the store."""
        body = json_object(raw)
        previous, wanted = None, previous_id(body)
        if wanted is not None and self.config.store:
            previous = await asyncio.to_thread(self.store.get, caller.scope, wanted,
                                               time.time())
            if previous is None:
                raise ServiceError(ErrorKind.NOT_FOUND, f"previous response {wanted!r} not found: it was never "
                                   "kept (store false), was deleted or expired, or is not yours",
                                   field="previous_response_id", reason="not_found")
            if previous[0]["status"] in ACTIVE:
                raise ServiceError(ErrorKind.CONFLICT, f"previous response {wanted!r} is {previous[0]['status']}: "
                                   "continue it once it has ended (poll GET /v1/responses/{id})",
                                   field="previous_response_id", reason="response_not_ended")
        conversation, joined = None, conversation_id(body)
        if joined is not None and self.config.store:
            found = await asyncio.to_thread(self.conversations.get, caller.scope, joined)
            if found is None:
                raise ServiceError(ErrorKind.NOT_FOUND, f"conversation {joined!r} not found: it was deleted, or is "
                                   "not yours", field="conversation", reason="not_found")
            conversation = (joined, await asyncio.to_thread(self.conversations.items, joined))
        request = parse_responses_body(body, previous, self.config if self.config.store else None, conversation)
        echo = request.responses
        echo.body = body
        if echo.store or echo.conversation_id:
            # what it keeps is kept when it ends, whatever its size: let in while under the limit
            require_room(self.front.book, caller, "store" if echo.store else "conversation")
        return request

    async def ended(self, caller: Caller, out) -> None:
        """A response that ended: kept when asked, its items added to its conversation."""
        kept = out.kept()
        if kept is not None:
            await self.keep(caller, *kept)
        await self.join(caller, out)

    async def join(self, caller: Caller, out) -> None:
        """Its input and output added to its conversation, if it has one and ended with an answer
        (a conversation deleted meanwhile takes nothing). Every response that ended, background
        ones too, passes here: expired rows and old stream events are deleted at most every
        PURGE_EVERY_S."""
        await self._purge()
        joined = out.joined()
        if joined is None:
            return
        try:
            await asyncio.to_thread(self.conversations.append, caller.scope, *joined)
        except Exception:          # the answer went out: its turn is missing from the conversation, said so
            log.exception("could not add response %s to conversation %s", out.id, joined[0])

    async def _purge(self) -> None:
        now = time.time()
        if now - self.purged > PURGE_EVERY_S:
            self.purged = now
            try:
                await asyncio.to_thread(self.store.purge, now, now - self.config.stream_events_s)
            except Exception as exc:           # again at the next
                log.warning("could not delete expired responses (%s)", exc)

    async def keep(self, caller: Caller, response: dict, input_items: list[dict]) -> None:
        now = time.time()
        try:
            await asyncio.to_thread(self.store.add, caller.name, response, input_items, now,
                                    now + self.config.retention_s)
        except Exception:          # the answer is made and billed: it goes out unkept
            self.outcomes.labels("failed").inc()
            log.exception("could not keep response %s", response["id"])
            return
        self.outcomes.labels("kept").inc()

    async def _kept(self, http: Request) -> tuple[dict, list[dict]]:
        response_id = http.path_params["response_id"]
        found = await asyncio.to_thread(self.store.get, self.front.caller(http).scope, response_id, time.time())
        if found is None:
            raise _missing(response_id)
        return found

    async def retrieve(self, http: Request) -> Response:
        """The response; with stream=true (a background one made with stream), its events after
        starting_after, to its last (responses_stream.py)."""
        try:
            stream = http.query_params.get("stream", "false").lower()
            if stream not in ("true", "1", "false", "0"):
                raise invalid(f"stream must be true or false, got {stream[:20]!r}", "stream")
            after = http.query_params.get("starting_after")
            if after is not None and not (after.isascii() and after.isdigit() and len(after) <= 9):
                raise invalid(f"starting_after must be an event's sequence number (0 or more), got {after[:20]!r}",
                              "starting_after")
            response, _ = await self._kept(http)
            if stream in ("true", "1"):
                return await self.background.stream_again(response, -1 if after is None else int(after))
        except ServiceError as error:
            return error_response(error)
        return JSONResponse(response)

    async def delete(self, http: Request) -> Response:
        try:
            response_id = http.path_params["response_id"]
            if not await asyncio.to_thread(self.store.delete, self.front.caller(http).scope, response_id, time.time()):
                await self._kept(http)           # its 404
        except ServiceError as error:
            return error_response(error)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, http: Request) -> Response:
        """A background response ends cancelled (a second cancel, or one of an ended response,
        answers it as it is); another response cannot be cancelled."""
        try:
            response, _ = await self._kept(http)
            if not response.get("background"):
                raise invalid(f"response {response['id']!r} was not made in the background: only a background "
                              "response can be cancelled (cancel a running request with "
                              "POST /v1/requests/{id}/cancel)", "response_id")
            found = await asyncio.to_thread(self.store.cancel, self.front.caller(http).scope, response["id"],
                                            time.time())
            if found is None:
                raise _missing(response["id"])
        except ServiceError as error:
            return error_response(error)
        if found[1]:
            self.background.cancel_here(response["id"])
        return JSONResponse(found[0])

    async def input_items(self, http: Request) -> Response:
        try:
            query = page_query(http.query_params)
            _, items = await self._kept(http)
        except ServiceError as error:
            return error_response(error)
        return JSONResponse(item_page(items, query))

def _missing(response_id: str) -> ServiceError:
    return ServiceError(ErrorKind.NOT_FOUND, f"no response {response_id[:80]!r} here (responses are kept when made "
                        "with store true, until deleted or expired)", reason="not_found")
