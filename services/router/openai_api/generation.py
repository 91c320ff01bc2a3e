"""One OpenAI completion request answered over HTTP: run it on the shared request path (a request
a choice when it asks for n choices or sends a batch of prompts: services/router/openai_api/choices.py) and
send the result as one JSON body or as Server-Sent Events, with the caller's rate-limit headers."""
from __future__ import annotations

import asyncio
import contextlib
import time

from starlette.responses import JSONResponse, Response

from services.common.errors import ErrorKind, ServiceError
from services.common.step import GUIDES
from services.common.wire import prompt_chars
from services.control.limits import estimate_tokens
from services.control.tenancy import Caller
from services.router.openai_api.choices import choice_body, choice_heads, merged, one_choice
from services.router.openai_api.request import CHAT, OpenAIRequest
from services.router.openai_api.response import OpenAIResponse, error_body
from services.router.openai_api.responses_output import ResponsesAnswer
from services.router.openai_api.sglang import SglangAnswer
from services.router.openai_api.tgi import TgiAnswer, tgi_error
from services.router.validation import RequestHead, check_sampling

TOKEN_IDS = "prompt_token_ids"     # the scheduler's name for a prompt given as token ids
SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache",
               "x-accel-buffering": "no"}


def http_param(field: str | None, request: OpenAIRequest | None) -> str | None:
    """Our field names (the gRPC request's) as the OpenAI body parameter a client sent."""
    own = request and (request.responses or request.tgi or request.sglang)
    if own is not None:                              # such a body names them its way
        return own.param(_chat_param(field, request))
    return _chat_param(field, request)


def _chat_param(field: str | None, request: OpenAIRequest | None) -> str | None:
    if field is not None and field.startswith("chat_template."):    # ChatTemplateOptions' are the body's own
        return field.removeprefix("chat_template.").replace("kwargs_json", "chat_template_kwargs")
    if field is None or request is None:
        return field
    if field == "sampling.max_tokens":
        return request.max_tokens_field
    if field == "prompt" and request.kind == CHAT:
        return "messages"
    if field.startswith(TOKEN_IDS):
        return "prompt" + field.removeprefix(TOKEN_IDS)
    guide = next((f"sampling.{name}" for name in GUIDES if field.startswith(f"sampling.{name}")), None)
    if guide and request.schema_field:      # the one structured output the request has
        return request.schema_field + field.removeprefix(guide)
    return field.removeprefix("sampling.")


def error_response(error: ServiceError, request: OpenAIRequest | None = None,
                   request_id: str | None = None, headers: dict | None = None, tgi: bool = False) -> JSONResponse:
    """OpenAI's error object and status (TGI's, for a TGI request or route: tgi.py)."""
    headers = dict(headers or {})
    if error.retry_after_ms is not None:
        headers.update({"retry-after": str(error.retry_after_seconds),
                        "retry-after-ms": str(error.retry_after_ms)})
    if request_id:
        headers["x-request-id"] = request_id
    if error.kind is ErrorKind.REQUEST_TIMEOUT:      # the rest of a stalled body must not be read as a request
        headers["connection"] = "close"
    if tgi or (request is not None and request.tgi is not None):
        status, body = tgi_error(error, http_param(error.field, request))
        return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse(error_body(error, http_param(error.field, request)),
                        status_code=error.kind.status.http, headers=headers)


class GenerationResponse(Response):
    """Runs one request on the shared path and answers it, as JSON or as SSE. Until the first
    chunk arrives nothing is sent, so a refusal is a real HTTP status; after it, an error is a
    final `data: {"error": ...}` event. A client that disconnects cancels the request all the
    way to its worker (the cancellation runs through RequestPath.relay)."""

    def __init__(self, front, head: RequestHead, caller: Caller, request: OpenAIRequest, parent):
        self.front, self.head, self.caller = front, head, caller
        self.request, self.parent = request, parent
        self.client_gone = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        try:
            self.front.drain.enter()          # refused if the drain began since the body was read
        except ServiceError as error:
            await self._error(error, scope, send)
            return
        try:
            work = asyncio.create_task(self._answer(scope, send))
            gone = asyncio.create_task(_disconnected(receive, self.client_gone))
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not work.done():       # the client went away first
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        finally:
            self.front.drain.leave()

    def _headers(self) -> dict[str, str]:
        """x-request-id, and the caller's x-ratelimit-* as they stand now."""
        return {"x-request-id": self.head.request_id, **self.front.book.headers(self.caller)}

    async def _error(self, error: ServiceError, scope, send) -> None:
        await error_response(error, self.request, headers=self._headers())(scope, None, send)

    async def _answer(self, scope, send) -> None:
        request, head = self.request, self.head
        out = answer_object(request, head)
        chunks = choice_chunks(self.front.path, head, self.caller, request, self.parent)
        self.started = False
        try:
            if request.stream:
                await self._stream(out, chunks, scope, send)
            else:
                await self._whole(out, chunks, scope, send)
        except asyncio.CancelledError:
            if self.client_gone.is_set():
                raise
            # Cancelled on our side (the Cancel API): the client still deserves an answer.
            cancelled = ServiceError(ErrorKind.CANCELLED, f"request {head.request_id} was cancelled",
                                     reason="cancelled")
            if self.started:
                tail = out.failed(cancelled, None)
                await self._keep(out)
                await send({"type": "http.response.body", "more_body": False, "body": tail})
            else:
                await self._error(cancelled, scope, send)
        finally:
            await chunks.aclose()      # cancelled mid-way: the relay cancels the scheduler's call

    async def _whole(self, out: OpenAIResponse, chunks, scope, send) -> None:
        try:
            await _fill(out, chunks)
        except ServiceError as error:
            await self._error(error, scope, send)
            return
        body = out.body()
        await self._keep(out)
        await JSONResponse(body, headers=self._headers())(scope, None, send)

    async def _stream(self, out: OpenAIResponse, chunks, scope, send) -> None:
        try:
            index, chunk = await anext(chunks)
        except ServiceError as error:
            await self._error(error, scope, send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": _raw({**SSE_HEADERS, **self._headers()})})
        self.started = True
        try:
            while True:
                frames = out.frames(index, chunk)
                if out.finished:
                    await self._keep(out)        # before its last event: the next turn may name it at once
                await send({"type": "http.response.body", "body": frames, "more_body": True})
                if out.finished:
                    break
                index, chunk = await anext(chunks)
            tail = out.end()
        except ServiceError as error:
            tail = out.failed(error, http_param(error.field, self.request))
            await self._keep(out)
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _keep(self, out) -> None:
        """A Responses API answer that ended: kept when asked (store), its items added to its
        conversation (responses_kept.py)."""
        if isinstance(out, ResponsesAnswer):
            await self.front.kept_responses.ended(self.caller, out)


def answer_object(request: OpenAIRequest, head: RequestHead):
    """What a request's chunks become: a chat or completion object, or a Responses API one."""
    answer = ResponsesAnswer if request.responses is not None else TgiAnswer if request.tgi is not None \
        else SglangAnswer if request.sglang is not None else OpenAIResponse
    return answer(request, head.request_id, int(time.time()), head.priority)


def choice_chunks(path, head: RequestHead, caller: Caller, request: OpenAIRequest, parent):
    """(choice index, chunk) of a request on the shared path: one stream, or a request a choice
    merged (n choices, a batch of prompts; services/router/openai_api/choices.py)."""
    if request.choices == 1:
        return one_choice(_serve(path, head, caller, request, request.body, parent))
    heads = choice_heads(head, request.n, request.choices)
    streams = []
    for index, choice_head in enumerate(heads):
        if len(request.prompts) <= 1:
            streams.append(_serve(path, choice_head, caller, request, choice_body(request.body, choice_head.choice),
                                  parent))
        else:       # a batch's prompt, its seed
            prompt = index // request.n
            body = choice_body(request.body, choice_head.choice, request.prompts[prompt])
            streams.append(_in_prompt(_serve(path, choice_head, caller, request, body, parent), prompt))
    return merged(streams, heads)


async def whole_answer(path, head: RequestHead, caller: Caller, request: OpenAIRequest, parent=None) -> dict:
    """A request's whole answer object (not streamed); a ServiceError when it is refused or fails."""
    out = answer_object(request, head)
    chunks = choice_chunks(path, head, caller, request, parent)
    try:
        await _fill(out, chunks)
    finally:
        await chunks.aclose()
    return out.body()


async def _fill(out, chunks) -> None:
    """Every choice's chunks into the answer object, up to each one's last."""
    async for index, chunk in chunks:
        out.add(index, chunk)
        if out.finished:
            break


def _serve(path, head: RequestHead, caller: Caller, request: OpenAIRequest, body, parent):
    """One choice's request on the shared path."""
    def read_body(max_context: int | None):
        check_sampling(body.sampling, max_context)
        return body

    estimate = estimate_tokens(prompt_chars(body), body.sampling.max_tokens if body.sampling.HasField("max_tokens") else None)
    return path.serve(head, read_body, caller, estimate, parent, {"qos.user": request.user})


async def _in_prompt(stream, index: int):
    """A batch's choice: an error naming its prompt's token ids names them in its prompt."""
    try:
        async for chunk in stream:
            yield chunk
    except ServiceError as error:
        if error.field and error.field.startswith(TOKEN_IDS):
            named = f"prompt[{index}]{error.field.removeprefix(TOKEN_IDS)}"
            error.message, error.field = error.message.replace(error.field, named), named
        raise
    finally:
        await stream.aclose()


async def _disconnected(receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


def _raw(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode("latin-1")) for k, v in headers.items()]
