"""The router's OpenAI-compatible HTTP front: an ASGI app (Starlette) served by uvicorn inside the
router's own event loop, on the same request path as gRPC (services/router/request_path.py).

Why this shape: in the router's loop, an HTTP request reaches the shared priority intake, pool
cache and scheduler channels with no thread hop or copy; Starlette (not FastAPI) because the
bodies are checked by our own parser (services/router/openai_request.py), which names each bad
field precisely and costs no model building per request; uvicorn's httptools parser is its
fastest. bench/http_overhead.py measures what the front costs against gRPC.

    POST /v1/chat/completions, /v1/completions   JSON or Server-Sent Events (stream: true)
    GET  /v1/models, /health, /metrics
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.common.config import RouterConfig
from services.common.errors import ErrorKind, ServiceError
from services.common.priority import PRIORITY_HEADER
from services.common.tracing import extract_metadata
from services.router.openai_request import CHAT, COMPLETION, OpenAIRequest, parse_openai
from services.router.openai_response import OpenAIResponse, error_body
from services.router.validation import RequestHead, check_sampling, parse_head

log = logging.getLogger(__name__)

HEADERS = ("x-priority", "x-tenant", "x-slo-ms", "x-lora")
SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache",
               "x-accel-buffering": "no"}


def to_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def http_param(field: str | None, request: OpenAIRequest | None) -> str | None:
    """Our field names (the gRPC request's) as the OpenAI body parameter a client sent."""
    if field is None or request is None:
        return field
    if field == "sampling.max_tokens":
        return request.max_tokens_field
    if field == "prompt" and request.kind == CHAT:
        return "messages"
    return field.removeprefix("sampling.")


def error_response(error: ServiceError, request: OpenAIRequest | None = None,
                   request_id: str | None = None) -> JSONResponse:
    headers = {}
    if error.retry_after_ms is not None:
        headers = {"retry-after": str(error.retry_after_seconds),
                   "retry-after-ms": str(error.retry_after_ms)}
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(error_body(error, http_param(error.field, request)),
                        status_code=error.kind.status.http, headers=headers)


class GenerationResponse(Response):
    """Runs one request on the shared path and answers it, as JSON or as SSE. Until the first
    chunk arrives nothing is sent, so a refusal is a real HTTP status; after it, an error is a
    final `data: {"error": ...}` event. A client that disconnects cancels the request all the
    way to its worker (the cancellation runs through RequestPath.relay)."""

    def __init__(self, front: HttpFront, head: RequestHead, request: OpenAIRequest, parent):
        self.front, self.head, self.request, self.parent = front, head, request, parent

    async def __call__(self, scope, receive, send) -> None:
        try:
            self.front.drain.enter()          # refused if the drain began since the body was read
        except ServiceError as error:
            await self._error(error, scope, send)
            return
        try:
            work = asyncio.create_task(self._answer(scope, send))
            gone = asyncio.create_task(_disconnected(receive))
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not work.done():       # the client went away first
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        finally:
            self.front.drain.leave()

    async def _error(self, error: ServiceError, scope, send) -> None:
        await error_response(error, self.request, self.head.request_id)(scope, None, send)

    async def _answer(self, scope, send) -> None:
        request, head = self.request, self.head
        out = OpenAIResponse(request, head.request_id, int(time.time()), head.priority)

        def read_body(max_context: int | None):
            check_sampling(request.body.sampling, max_context)
            return request.body

        chunks = self.front.path.serve(head, read_body, self.parent, {"qos.user": request.user})
        try:
            if request.stream:
                await self._stream(out, chunks, scope, send)
            else:
                await self._whole(out, chunks, scope, send)
        finally:
            await chunks.aclose()      # cancelled mid-way: the relay cancels the scheduler's call

    async def _whole(self, out: OpenAIResponse, chunks, scope, send) -> None:
        try:
            async for chunk in chunks:
                out.add(chunk)
                if chunk.finish_reason:
                    break
        except ServiceError as error:
            await self._error(error, scope, send)
            return
        await JSONResponse(out.body(), headers={"x-request-id": self.head.request_id})(
            scope, None, send)

    async def _stream(self, out: OpenAIResponse, chunks, scope, send) -> None:
        try:
            chunk = await anext(chunks)
        except ServiceError as error:
            await self._error(error, scope, send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": _raw({**SSE_HEADERS, "x-request-id": self.head.request_id})})
        try:
            while True:
                body = b"".join(b"data: " + to_json(e) + b"\n\n" for e in out.events(chunk))
                await send({"type": "http.response.body", "body": body, "more_body": True})
                if chunk.finish_reason:
                    break
                chunk = await anext(chunks)
            tail = b"data: [DONE]\n\n"
        except ServiceError as error:
            tail = b"data: " + to_json(error_body(error, http_param(error.field, self.request))) + b"\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _raw(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode("latin-1")) for k, v in headers.items()]


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield      # the router's run_server owns SIGTERM/SIGINT and drains the HTTP front too


class HttpFront:
    def __init__(self, router, config: RouterConfig):
        self.path, self.pools, self.drain = router.path, router.pools, router.drain
        self.registry = router.totals.registry
        self.config = config
        self.started = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_error})
        self.server: _EmbeddedServer | None = None
        self.task: asyncio.Task | None = None

    async def chat(self, http: Request) -> Response:
        return await self._generation(http, CHAT)

    async def completions(self, http: Request) -> Response:
        return await self._generation(http, COMPLETION)

    async def _generation(self, http: Request, kind: str) -> Response:
        request = None
        try:
            self.drain.check()
            request = parse_openai(kind, await self._body(http))
            headers = {k: http.headers[k] for k in HEADERS if k in http.headers}
            if PRIORITY_HEADER not in headers and request.tier is not None:
                headers[PRIORITY_HEADER] = request.tier.label      # the header wins over the body
            head = parse_head(headers)
        except ServiceError as error:
            return error_response(error, request)
        except ClientDisconnect:      # gone while sending the body: nobody to answer
            return Response(status_code=499)
        return GenerationResponse(self, head, request, extract_metadata(http.headers.items()))

    async def _body(self, http: Request) -> bytes:
        limit = self.config.http_max_body_bytes
        too_large = ServiceError(ErrorKind.PAYLOAD_TOO_LARGE, f"the request body is over the "
                                 f"limit of {limit} bytes (router.http_max_body_bytes)",
                                 field="body", reason="body_too_large")
        length = http.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large
        body = bytearray()
        async for piece in http.stream():
            body += piece
            if len(body) > limit:
                raise too_large
        return bytes(body)

    async def models(self, http: Request) -> Response:
        seen = {}
        for stats in self.pools.latest_stats():
            if stats.model and stats.max_context:
                seen.setdefault(stats.model, {"id": stats.model, "object": "model",
                                              "created": self.started, "owned_by": "qos-serve",
                                              "max_model_len": stats.max_context, "pools": []})
                seen[stats.model]["pools"].append(stats.pool)
        return JSONResponse({"object": "list", "data": list(seen.values())})

    async def health(self, http: Request) -> Response:
        serving = [n for n, load in self.pools.router.loads.items() if load.healthy]
        ok = bool(serving) and not self.drain.draining
        return JSONResponse({"status": "ok" if ok else "unavailable", "pools": serving,
                             "draining": self.drain.draining}, status_code=200 if ok else 503)

    async def metrics(self, http: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def _http_error(self, http: Request, exc: HTTPException) -> Response:
        kind = ErrorKind.UNSUPPORTED if exc.status_code == 404 else ErrorKind.INVALID
        message = f"{http.method} {http.url.path}: {exc.detail}"
        return JSONResponse(error_body(ServiceError(kind, message, reason="no_route"), None),
                            status_code=exc.status_code, headers=exc.headers)

    # --- serving ----------------------------------------------------------------------------------

    async def start(self) -> int:
        """Serve on [router] host:http_port; returns the bound port."""
        config = uvicorn.Config(self.app, host=self.config.host, port=self.config.http_port,
                                lifespan="off", access_log=False, log_level="warning",
                                http="httptools", ws="none", timeout_graceful_shutdown=5)
        self.server = _EmbeddedServer(config)
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():      # uvicorn exits when it cannot bind
                raise OSError(f"router HTTP front: cannot serve on {self.config.http_address}")
            await asyncio.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        log.info("router HTTP (OpenAI API) on http://%s:%d/v1", self.config.host, port)
        return port

    async def stop(self) -> None:
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            with contextlib.suppress(BaseException):
                await self.task
