"""vLLM's POST /tokenize and /detokenize on the HTTP front: the served model's own tokenizer, at
the scheduler of a pool serving the model (Scheduler.Tokenize and Detokenize; the router holds
no tokenizer). Nothing is generated or billed; with auth required, a caller needs a key. Each
call is a request of its tenant, in the class its x-priority names: it counts against the
tenant's rpm, tpm (the prompt's estimated tokens, trued up to its count) and max_concurrent as a
generation does, and a refusal is the same 403 / 429 with its retry-after: tokenizing a 4 MiB
prompt takes seconds of a core at the pool's scheduler, which no tenant gets for free.

    /tokenize    {"model", "prompt"} (tokenized as a completion's prompt is, `add_special_tokens`
                 false by default) or {"model", "messages"} (rendered with the chat template as a
                 chat's prompt is) -> {"count", "max_model_len", "tokens", "token_strs"}
                 (`token_strs`: with `return_token_strs`, each token as the vocabulary spells it)
    /detokenize  {"model", "tokens": [ids]} -> {"prompt": the text, special tokens included}

With messages, vLLM's `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`
render them as on /v1/chat/completions (services/router/openai_api/vllm_options.py). A field either endpoint
does not serve is a 400 naming it, as on the generation endpoints.
"""
from __future__ import annotations

import contextlib
import math

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.common.errors import ErrorKind, ServiceError, invalid
from services.common.grpc_errors import error_from_rpc
from services.common.proto.qos.v1 import scheduler_pb2
from services.control.limits import CHARS_PER_TOKEN
from services.router.openai_api.generation import error_response
from services.router.openai_api.json_fields import bool_field, json_kind, text_field
from services.router.openai_api.request import chat_messages, json_object
from services.router.openai_api.vllm_options import CHAT_TEMPLATE, parse_chat_template
from services.router.validation import request_headers

CALL_TIMEOUT_S = 30.0
TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "return_token_strs", *CHAT_TEMPLATE}
DETOKENIZE_FIELDS = {"model", "tokens"}


async def tokenize(front, http: Request) -> Response:
    caller = None
    try:
        caller, body, handle = await _request(front, http, TOKENIZE_FIELDS)
        if ("prompt" in body) == ("messages" in body):
            raise invalid("send one of prompt (a string) and messages", "prompt")
        request = scheduler_pb2.TokenizeRequest()
        if "prompt" in body:
            request.prompt = text_field(body["prompt"], "prompt", allow_empty=False)
            if chat_options := next((name for name in CHAT_TEMPLATE if body.get(name) is not None), None):
                raise invalid(f"{chat_options} is for messages (rendered with the chat template), not a prompt",
                              chat_options)
        else:
            request.messages.extend(chat_messages(body["messages"]))
            parse_chat_template(body, request.chat_template)
        for name in ("add_special_tokens", "return_token_strs"):
            setattr(request, name, bool_field(body.get(name, False), name))
        async with _admitted(front, http, caller, _estimate(request)) as used:
            reply = await _call(handle, handle.scheduler.Tokenize, request)
            used.append(len(reply.token_ids))
    except ServiceError as error:
        return error_response(error, headers=front.book.headers(caller) if caller else None)
    return JSONResponse({"count": len(reply.token_ids), "max_model_len": reply.max_model_len,
                         "tokens": list(reply.token_ids),
                         "token_strs": list(reply.token_strs) if request.return_token_strs else None},
                        headers=front.book.headers(caller))


async def detokenize(front, http: Request) -> Response:
    caller = None
    try:
        caller, body, handle = await _request(front, http, DETOKENIZE_FIELDS)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise invalid("tokens must be a list of token ids", "tokens")
        for i, token in enumerate(tokens):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**31:
                raise invalid(f"tokens[{i}] must be a token id (an integer from 0), got "
                              f"{token if isinstance(token, int) else json_kind(token)}", f"tokens[{i}]")
        async with _admitted(front, http, caller, len(tokens)) as used:
            reply = await _call(handle, handle.scheduler.Detokenize, scheduler_pb2.DetokenizeRequest(token_ids=tokens))
            used.append(len(tokens))
    except ServiceError as error:
        if error.field and error.field.startswith("token_ids"):      # the scheduler's name for them
            error = ServiceError(error.kind, error.message.replace("token_ids[", "tokens["),
                                 field="tokens" + error.field.removeprefix("token_ids"), reason=error.reason)
        return error_response(error, headers=front.book.headers(caller) if caller else None)
    return JSONResponse({"prompt": reply.text}, headers=front.book.headers(caller))


def _estimate(request: scheduler_pb2.TokenizeRequest) -> int:
    """The prompt's tokens as the rate limits estimate a generation's (before it is tokenized)."""
    chars = len(request.prompt) + sum(len(m.content) + len(m.tool_calls) for m in request.messages)
    return math.ceil(chars / CHARS_PER_TOKEN)


@contextlib.asynccontextmanager
async def _admitted(front, http: Request, caller, estimate: int):
    """The call admitted as a request of the caller's tenant (its class from x-priority) and
    released when it ends, its tokens trued up to what the body yields into the list."""
    headers = request_headers(http.headers.items(), front.book.required)
    ticket = front.book.admit(caller, front.router.let_in(headers, caller).priority, max(1, estimate))
    used: list[int] = []
    try:
        yield used
    finally:
        front.book.release(ticket, used[0] if used else None, 0.0)


async def _request(front, http: Request, fields: set[str]) -> tuple[object, dict, object]:
    """The caller checked (a key, with auth required), the body read and its fields checked, and
    the handle of a pool serving its model."""
    caller = front.caller(http)
    body = {name: value for name, value in json_object(await front.body(http)).items() if value is not None}
    for name in body:
        if name not in fields:
            raise invalid(f"unknown field {name!r} for {http.url.path}", name)
    if "model" not in body:
        raise invalid("model is required", "model")
    model = text_field(body["model"], "model", allow_empty=False)
    served = front.served_models().get(model)
    handles = [front.pools.handles[p] for p in (served or {}).get("pools", ()) if p in front.pools.handles]
    if not handles:
        raise ServiceError(ErrorKind.NOT_FOUND, f"the model {model[:200]!r} is not served here (GET /v1/models "
                                                "lists them)", field="model", reason="model_not_found")
    return caller, body, handles[0]


async def _call(handle, method, request):
    try:
        return await method(request, timeout=CALL_TIMEOUT_S, metadata=handle.metadata)
    except grpc.aio.AioRpcError as exc:
        raise error_from_rpc(exc, handle.peer) from None
