"""OpenAI's Conversations API on the HTTP front: a conversation the Responses API reads from and
adds to (`conversation` on POST /v1/responses: its items come before the input; the input and the
output join it when the response ends with an answer).

    POST   /v1/conversations                        {items? (up to 20), metadata?}
    GET    /v1/conversations/{id};  POST it         {metadata}: set
    DELETE /v1/conversations/{id}                   it and its items
    POST   /v1/conversations/{id}/items             {items} (up to 20): added at its end
    GET    /v1/conversations/{id}/items             a page (after, limit 1-100, order: desc)
    GET    /v1/conversations/{id}/items/{item_id};  DELETE it

Each conversation is its tenant's (the caller's key; with auth off, x-tenant): to another it is
an id that does not exist, here and as a response's `conversation`; the admin key sees all. Items
are checked as a Responses body's input is (messages, function calls and their outputs) and get
ids. Kept in the store's database until deleted (services/store/conversation_store.py).
"""
from __future__ import annotations

import asyncio
import secrets
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.common.errors import ErrorKind, ServiceError, invalid
from services.control.storage_quota import storage_limit, storage_refusal
from services.router.openai_api.generation import error_response
from services.router.openai_api.item_pages import listed, page_query
from services.router.openai_api.request import json_object
from services.router.openai_api.responses_request import check_metadata, input_items
from services.store.storage_use import StorageFull

MAX_ITEMS_AT_ONCE = 20      # OpenAI's


class ConversationsFront:
    def __init__(self, front, store):
        self.front, self.store = front, store

    def _limit(self, caller) -> int | None:
        return storage_limit(caller, self.front.book.storage_mb)

    def routes(self) -> list[Route]:
        return [Route("/v1/conversations", self.create, methods=["POST"]),
                Route("/v1/conversations/{conversation_id}", self.retrieve, methods=["GET"]),
                Route("/v1/conversations/{conversation_id}", self.update, methods=["POST"]),
                Route("/v1/conversations/{conversation_id}", self.delete, methods=["DELETE"]),
                Route("/v1/conversations/{conversation_id}/items", self.add_items, methods=["POST"]),
                Route("/v1/conversations/{conversation_id}/items", self.list_items, methods=["GET"]),
                Route("/v1/conversations/{conversation_id}/items/{item_id}", self.item, methods=["GET"]),
                Route("/v1/conversations/{conversation_id}/items/{item_id}", self.delete_item, methods=["DELETE"])]


    async def _body(self, http: Request, allowed: set[str]) -> dict:
        body = json_object(await self.front.body(http) or b"{}")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise invalid(f"unknown field {unknown[0]!r}", unknown[0])
        return body

    async def _conversation(self, http: Request) -> dict:
        conversation_id = http.path_params["conversation_id"]
        found = await asyncio.to_thread(self.store.get, self.front.caller(http).scope, conversation_id)
        if found is None:
            raise ServiceError(ErrorKind.NOT_FOUND, f"no conversation {conversation_id[:80]!r} here",
                               reason="not_found")
        return found

    async def create(self, http: Request) -> Response:
        try:
            caller = self.front.caller(http)
            body = await self._body(http, {"items", "metadata"})
            items = _items(body.get("items"), required=False)
            meta = check_metadata(body["metadata"]) if body.get("metadata") is not None else {}
            found = await asyncio.to_thread(self.store.create, "conv_" + secrets.token_hex(16), caller.name, meta,
                                            items, time.time(), self._limit(caller))
        except StorageFull as full:
            return error_response(storage_refusal(full, "items"))
        except ServiceError as error:
            return error_response(error)
        return JSONResponse(_shown(found))

    async def retrieve(self, http: Request) -> Response:
        try:
            return JSONResponse(_shown(await self._conversation(http)))
        except ServiceError as error:
            return error_response(error)

    async def update(self, http: Request) -> Response:
        try:
            found = await self._conversation(http)
            body = await self._body(http, {"metadata"})
            meta = check_metadata(body.get("metadata") or {})
            caller = self.front.caller(http)
            found = await asyncio.to_thread(self.store.set_metadata, caller.scope, found["id"], meta,
                                            self._limit(caller))
        except StorageFull as full:
            return error_response(storage_refusal(full, "metadata"))
        except ServiceError as error:
            return error_response(error)
        return JSONResponse(_shown(found))

    async def delete(self, http: Request) -> Response:
        try:
            found = await self._conversation(http)
            await asyncio.to_thread(self.store.delete, self.front.caller(http).scope, found["id"])
        except ServiceError as error:
            return error_response(error)
        return JSONResponse({"id": found["id"], "object": "conversation.deleted", "deleted": True})

    async def add_items(self, http: Request) -> Response:
        try:
            found = await self._conversation(http)
            items = _items((await self._body(http, {"items"})).get("items"), required=True)
            caller = self.front.caller(http)
            await asyncio.to_thread(self.store.append, caller.scope, found["id"], items, self._limit(caller))
        except StorageFull as full:
            return error_response(storage_refusal(full, "items"))
        except ServiceError as error:
            return error_response(error)
        return JSONResponse(listed(items, False))

    async def list_items(self, http: Request) -> Response:
        try:
            found = await self._conversation(http)
            limit, order, after = page_query(http.query_params)
            items, more = await asyncio.to_thread(self.store.items_page, found["id"], limit, order, after)
        except ServiceError as error:
            return error_response(error)
        return JSONResponse(listed(items, more))

    async def item(self, http: Request) -> Response:
        try:
            found = await self._conversation(http)
            wanted = http.path_params["item_id"]
            item = await asyncio.to_thread(self.store.item, found["id"], wanted)
            if item is None:
                raise ServiceError(ErrorKind.NOT_FOUND, f"no item {wanted[:80]!r} in this conversation",
                                   reason="not_found")
        except ServiceError as error:
            return error_response(error)
        return JSONResponse(item)

    async def delete_item(self, http: Request) -> Response:
        try:
            found = await self._conversation(http)
            wanted = http.path_params["item_id"]
            if not await asyncio.to_thread(self.store.delete_item, found["id"], wanted):
                raise ServiceError(ErrorKind.NOT_FOUND, f"no item {wanted[:80]!r} in this conversation",
                                   reason="not_found")
        except ServiceError as error:
            return error_response(error)
        return JSONResponse(_shown(found))


def _items(items, required: bool) -> list[dict]:
    if items is None and not required:
        return []
    if isinstance(items, list) and len(items) > MAX_ITEMS_AT_ONCE:
        raise invalid(f"items holds {len(items)} items: at most {MAX_ITEMS_AT_ONCE} are added at a time", "items")
    return input_items(items)


def _shown(conversation: dict) -> dict:
    return {k: v for k, v in conversation.items() if k != "tenant"}
