"""The router's OpenAI-compatible HTTP front: an ASGI app (Starlette) served by uvicorn inside the
router's own event loop, on the same request path as gRPC (services/router/request_path.py).

Why this shape: in the router's loop, an HTTP request reaches the shared priority intake, pool
cache and scheduler channels with no thread hop or copy; Starlette (not FastAPI) because the
bodies are checked by our own parser (services/router/openai_api/request.py), which names each bad
field precisely and costs no model building per request; uvicorn's httptools parser is its
fastest. bench/http_overhead.py measures what the front costs against gRPC.

    POST /v1/chat/completions, /v1/completions, /v1/responses   JSON or Server-Sent Events
    GET/DELETE /v1/responses/ID (kept answers: responses_kept.py); /v1/files, /v1/batches (batch_front.py)
    GET  /v1/models[/MODEL], /v1/usage, /v1/requests/ID, /health, /metrics
    POST /v1/requests/ID/cancel
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from dataclasses import replace

import uvicorn
from google.protobuf.json_format import MessageToDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.common.config import RouterConfig
from services.common.errors import ErrorKind, ServiceError, invalid
from services.common.priority import CONTEXT_MODE_HEADER, MAX_STREAM_INTERVAL, PRIORITY_HEADER, TENANT_HEADER
from services.common.tracing import extract_metadata
from services.control import adapter_admin
from services.control.console_feed import CONSOLE_DIR
from services.control.sla import ALL_TENANTS
from services.router.openai_api import tokenize_front
from services.router.openai_api.app_errors import APP_ERRORS
from services.router.openai_api.batch_front import BatchFront
from services.router.openai_api.body import read_body
from services.router.openai_api.conversations import ConversationsFront
from services.router.openai_api.generation import GenerationResponse, error_response
from services.router.openai_api.service_class import class_header
from services.router.openai_api.request import CHAT, COMPLETION, json_object, parse_openai
from services.router.openai_api.responses_kept import KeptResponses
from services.router.openai_api.responses_request import RESPONSES
from services.router.openai_api.sglang import SGLANG, is_sglang, parse_sglang
from services.router.openai_api.tgi import TGI, parse_tgi, tgi_info
from services.router.openai_api.response import error_body
from services.router.openai_api.timeouts import read_timeout_protocol
from services.router.validation import request_headers

CONSOLE_FILES = {name: ((CONSOLE_DIR / name).read_bytes(), media_type) for name, media_type in (
    ("index.html", "text/html; charset=utf-8"), ("console.js", "text/javascript; charset=utf-8"),
    ("console.css", "text/css; charset=utf-8"))}

log = logging.getLogger(__name__)

# ASCII digits (str.isdigit() takes "²", which float() refuses), and not so many that float() says inf.
SECONDS = re.compile(r"[0-9]{1,12}(\.[0-9]{0,9})?|\.[0-9]{1,9}")


def unix_seconds(value: str | None, field: str) -> float | None:
    """A query parameter in unix seconds, as a float (None when absent); INVALID naming it else."""
    if value is None:
        return None
    if not SECONDS.fullmatch(value):
        raise ServiceError(ErrorKind.INVALID, f"{field} must be unix seconds (at most 12 digits, then an "
                           f"optional fraction), got {value[:40]!r}", field=field, reason="invalid_argument")
    return float(value)


class WithoutTenants:
    """A registry's metrics less every sample labelled with a tenant's name (for anonymous
    scrapes); class-wide series (tenant="*") stay."""

    def __init__(self, registry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            kept = [sample for sample in family.samples if sample.labels.get("tenant", ALL_TENANTS) == ALL_TENANTS]
            if kept or not family.samples:
                family.samples = kept
                yield family


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield      # the router's run_server owns SIGTERM/SIGINT and drains the HTTP front too


class HttpFront:
    def __init__(self, router, config: RouterConfig):
        self.router = router
        self.path, self.pools, self.drain = router.path, router.pools, router.drain
        self.book, self.accounts = router.book, router.accounts
        self.registry = router.totals.registry
        self.config = config
        self.started = int(time.time())
        batch = BatchFront(self, router.batches, router.batch_config, router.batch_wake)
        kept = self.kept_responses = KeptResponses(self, router.kept_responses, router.responses_config, self.registry,
                                                   router.book.replica, router.conversations)
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            *kept.routes(),
            *ConversationsFront(self, router.conversations).routes(),
            Route("/generate", functools.partial(self._generation_of, TGI, False), methods=["POST"]),
            Route("/generate_stream", functools.partial(self._generation_of, TGI, True), methods=["POST"]),
            Route("/", functools.partial(self._generation_of, TGI, None), methods=["POST"]),
            Route("/info", self.tgi_info, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/files", batch.upload, methods=["POST"]),
            Route("/v1/files", batch.list_files, methods=["GET"]),
            Route("/v1/files/{file_id}", batch.file, methods=["GET"]),
            Route("/v1/files/{file_id}", batch.delete_file, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", batch.file_content, methods=["GET"]),
            Route("/v1/batches", batch.create, methods=["POST"]),
            Route("/v1/batches", batch.list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", batch.batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", batch.cancel, methods=["POST"]),
            Route("/tokenize", functools.partial(tokenize_front.tokenize, self), methods=["POST"]),
            Route("/detokenize", functools.partial(tokenize_front.detokenize, self), methods=["POST"]),
            Route("/v1/usage", self.usage, methods=["GET"]),
            Route("/v1/alerts", self.alerts, methods=["GET"]),
            Route("/v1/load_lora_adapter", self.load_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_adapter, methods=["POST"]),
            Route("/console", self.console_page, methods=["GET"]),
            Route("/console/events", self.console_events, methods=["GET"]),
            Route("/console/{name:str}", self.console_file, methods=["GET"]),
            Route("/v1/requests/{request_id}", self.request_status, methods=["GET"]),
            Route("/v1/requests/{request_id}/cancel", self.cancel, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_error, **APP_ERRORS})
        self.server: _EmbeddedServer | None = None
        self.task: asyncio.Task | None = None

    async def chat(self, http: Request) -> Response:
        return await self._generation(http, CHAT)

    async def completions(self, http: Request) -> Response:
        return await self._generation(http, COMPLETION)

    async def responses(self, http: Request) -> Response:
        """OpenAI's Responses API: a chat request in other words (responses_request.py)."""
        return await self._generation(http, RESPONSES)

    async def _generation_of(self, kind: str, stream: bool | None, http: Request) -> Response:
        return await self._generation(http, kind, stream)

    async def _generation(self, http: Request, kind: str, stream: bool | None = None) -> Response:
        request, shape = None, kind
        try:
            headers = request_headers(http.headers.items(), self.book.required)
            caller = self.router.identify(headers)       # before the body: a stranger's is never read
            raw = await self.body(http)
            if kind == RESPONSES:
                request = await self.kept_responses.parse(raw, caller)
            elif kind == TGI:        # /generate is SGLang's too: its body tells (sglang.py)
                body = json_object(raw)
                shape = SGLANG if stream is False and is_sglang(body) else TGI
                request = parse_sglang(body, self.path.model_name) if shape == SGLANG \
                    else parse_tgi(body, self.path.model_name, stream)
            else:
                request = parse_openai(kind, raw)
            label = class_header(request, headers.get(PRIORITY_HEADER))
            if label is not None:
                headers[PRIORITY_HEADER] = label
            if request.context_mode is not None:
                sent = headers.setdefault(CONTEXT_MODE_HEADER, request.context_mode)
                if sent.strip().lower() != request.context_mode:
                    raise invalid(f"context_mode {request.context_mode!r} and the x-context-mode header "
                                  f"{sent!r} differ: send one of them", "context_mode")
            head = self.router.let_in(headers, caller)
            most = caller.tenant.max_concurrent
            if not caller.admin and most is not None and request.choices > most:
                # Each choice is a stream: more than the tenant may hold would be refused for ever.
                raise invalid(f"{request.choices} choices are {request.choices} streams; tenant {caller.name!r} "
                              f"may hold {most} at once (max_concurrent)", "n" if request.n > 1 else "prompt")
            if not request.stream and not head.stream_interval:
                # The answer goes out whole: tokens come from the scheduler in as few chunks as
                # it may send (the first, one per max hold, the last), not one message per token.
                head = replace(head, stream_interval=MAX_STREAM_INTERVAL)
            if request.prompt_only:
                head = replace(head, prompt_only=True)
            if request.responses is not None and request.responses.background:
                return await self.kept_responses.background.start(
                    head, caller, request, {"x-request-id": head.request_id, **self.book.headers(caller)})
        except ServiceError as error:
            self.router.totals.refused_early(error)
            return error_response(error, request, tgi=shape == TGI)
        return GenerationResponse(self, head, caller, request, extract_metadata(http.headers.items()))

    def caller(self, http: Request):
        """Who sends the request: its key's tenant (or, with auth off, x-tenant's); UNAUTHENTICATED
        when auth is required and the key is missing or unknown."""
        headers = request_headers(http.headers.items(), self.book.required)
        return self.book.authenticate(headers.get("authorization"), headers.get(TENANT_HEADER, ""))

    async def usage(self, http: Request) -> Response:
        """GET /v1/usage[?tenant=T][&since=UNIX_S]: from the ledger; a tenant key sees its own."""
        try:
            usage = await self.accounts.usage(self.caller(http), http.query_params.get("tenant"),
                                              unix_seconds(http.query_params.get("since"), "since"))
        except ServiceError as error:
            return error_response(error)
        return JSONResponse({"object": "usage", **usage})

    async def alerts(self, http: Request) -> Response:
        """GET /v1/alerts: Router.Alerts as JSON (objectives now, open and recent alerts)."""
        try:
            caller = self.caller(http)
        except ServiceError as error:
            return error_response(error)
        reply = self.router.sla.reply_to(caller, self.book.required)
        body = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        for item in body["objectives"] + body["alerts"]:
            item["priority"] = item["priority"].removeprefix("PRIORITY_").lower()
        return JSONResponse({"object": "alerts", **body})

    async def load_adapter(self, http: Request) -> Response:
        return await self._adapter_admin(http, adapter_admin.load)

    async def unload_adapter(self, http: Request) -> Response:
        return await self._adapter_admin(http, adapter_admin.unload)

    async def _adapter_admin(self, http: Request, action) -> Response:
        """The admin key in every mode: it changes what every tenant is served."""
        try:
            self._admin(http, "loading and unloading LoRA adapters")
            body = json_object(await self.body(http) or b"{}")      # (an empty body: no fields)
            return JSONResponse(await action(self.pools, body))
        except ServiceError as error:
            return error_response(error)

    async def console_page(self, http: Request) -> Response:
        return await self.console_file(http, "index.html")

    async def console_file(self, http: Request, name: str | None = None) -> Response:
        """The console's page and its two files (services/control/console/), no build step."""
        name = name or http.path_params["name"]
        if name not in CONSOLE_FILES:
            return error_response(ServiceError(ErrorKind.NOT_FOUND, f"no console file {name!r}", reason="not_found"))
        body, media_type = CONSOLE_FILES[name]
        return Response(body, media_type=media_type, headers={"cache-control": "no-cache"})

    async def console_events(self, http: Request) -> Response:
        """The console's live feed (server-sent events, one snapshot a second). The admin key sees
        the cluster in every mode; with auth on a tenant's key sees its own tenant; with auth off
        nobody else is anyone (a tenant is whatever x-tenant says), so the page asks for the key."""
        try:
            caller = self.caller(http)
            if not caller.admin and not self.book.required:
                self._admin(http, "the console's cluster view", caller)
        except ServiceError as error:
            return error_response(error)
        view, tenant = ("admin", None) if caller.admin else (f"tenant {caller.name}", caller.name)
        return StreamingResponse(self.router.console.stream(view, tenant), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def request_status(self, http: Request) -> Response:
        try:
            found = await self.accounts.request(self.caller(http), http.path_params["request_id"])
        except ServiceError as error:
            return error_response(error)
        return JSONResponse({"object": "request", **found})

    async def cancel(self, http: Request) -> Response:
        try:
            entry = self.accounts.cancel(self.caller(http), http.path_params["request_id"])
        except ServiceError as error:
            return error_response(error)
        return JSONResponse({"object": "request", "request_id": entry.request_id, "tenant": entry.tenant,
                             "status": "cancelled"})

    async def body(self, http: Request) -> bytes:
        """The request's body within the front's size and time limits (body.py)."""
        return await read_body(http, self.config.http_max_body_bytes, self.config.http_read_timeout_s)

    async def tgi_info(self, http: Request) -> Response:
        """TGI's GET /info (tgi.py): the first model served, its context window."""
        served = next(iter(self.served_models().values()), None)
        if served is None:
            return error_response(ServiceError(ErrorKind.UNAVAILABLE, "no pool is serving yet", retry_after_ms=1000,
                                               reason="no_pool"), tgi=True)
        return JSONResponse(tgi_info(served["id"], served["max_model_len"], self.config.http_max_body_bytes))

    async def models(self, http: Request) -> Response:
        return JSONResponse({"object": "list", "data": list(self.served_models().values())})

    async def model(self, http: Request) -> Response:
        """GET /v1/models/{model} (OpenAI's retrieve): one entry of the list, or 404."""
        name = http.path_params["model"]
        found = self.served_models().get(name)
        if found is None:
            return error_response(ServiceError(ErrorKind.NOT_FOUND, f"the model {name[:200]!r} is not served here "
                                               "(GET /v1/models lists them)", field="model", reason="model_not_found"))
        return JSONResponse(found)

    def served_models(self) -> dict[str, dict]:
        """/v1/models' entries by id: each model a pool serves, and each LoRA adapter."""
        seen = {}
        for stats in self.pools.latest_stats():
            if stats.model and stats.max_context:
                seen.setdefault(stats.model, {"id": stats.model, "object": "model",
                                              "created": self.started, "owned_by": "qos-serve",
                                              "max_model_len": stats.max_context, "pools": []})
                seen[stats.model]["pools"].append(stats.pool)
        # LoRA adapters as models of their own (as vLLM lists them): `model: "NAME"` picks one.
        for stats in self.pools.latest_stats():
            for adapter in stats.adapters:
                entry = seen.setdefault(adapter, {"id": adapter, "object": "model", "created": self.started,
                                                  "owned_by": "qos-serve", "parent": stats.model,
                                                  "max_model_len": stats.max_context, "pools": []})
                entry["pools"].append(stats.pool)
        return seen

    async def health(self, http: Request) -> Response:
        serving = [n for n, load in self.pools.router.loads.items() if load.healthy]
        ok = bool(serving) and not self.drain.draining
        return JSONResponse({"status": "ok" if ok else "unavailable", "pools": serving,
                             "draining": self.drain.draining}, status_code=200 if ok else 503)

    async def metrics(self, http: Request) -> Response:
        """The router's metrics; this port is public, the metrics port ([router] metrics_port)
        serves them all. With auth on, the admin key only: class-wide counts move with every
        tenant's requests, and a tenant that subtracted its own would read another's. With auth
        off (tenants are labels) anyone, less the series labelled with a tenant (SLA objectives)."""
        try:
            caller = self.caller(http)
            admin = caller.admin
            if self.book.required and not admin:
                self._admin(http, "with auth on, the router's metrics (they count every tenant's requests)", caller)
        except ServiceError as error:
            if self.book.required:
                return error_response(error)
            admin = False
        return Response(generate_latest(self.registry if admin else WithoutTenants(self.registry)),
                        media_type=CONTENT_TYPE_LATEST)

    def _admin(self, http: Request, what: str, caller=None) -> None:
        """Refuses `what` to anyone without the admin key, auth on or off (PERMISSION_DENIED);
        `caller`: the request's, where the endpoint has authenticated it already."""
        if (caller or self.caller(http)).admin:
            return
        hint = "" if self.book.admin_key else "; none is configured: set [auth] admin_key or $QOS_ADMIN_KEY"
        raise ServiceError(ErrorKind.PERMISSION_DENIED, f"{what} needs the admin key{hint}",
                           field="authorization", reason="admin_only")

    async def _http_error(self, http: Request, exc: HTTPException) -> Response:
        kind = ErrorKind.UNSUPPORTED if exc.status_code == 404 else ErrorKind.INVALID
        message = f"{http.method} {http.url.path}: {exc.detail}"
        return JSONResponse(error_body(ServiceError(kind, message, reason="no_route"), None),
                            status_code=exc.status_code, headers=exc.headers)

    # --- serving ----------------------------------------------------------------------------------

    async def start(self) -> int:
        """Serve on [router] host:http_port; returns the bound port."""
        tls = {"ssl_certfile": self.config.tls_cert, "ssl_keyfile": self.config.tls_key} \
            if self.config.tls_cert else {}
        config = uvicorn.Config(self.app, host=self.config.host, port=self.config.http_port,
                                lifespan="off", access_log=False, log_level="warning",
                                http=read_timeout_protocol(self.config.http_read_timeout_s), ws="none",
                                timeout_graceful_shutdown=5, **tls)
        self.server = _EmbeddedServer(config)
        self.task = asyncio.create_task(self.server.serve())
        self.kept_responses.background.begin()
        while not self.server.started:
            if self.task.done():      # uvicorn exits when it cannot bind
                raise OSError(f"router HTTP front: cannot serve on {self.config.http_address}")
            await asyncio.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        log.info("router HTTP (OpenAI API) on %s://%s:%d/v1", "https" if self.config.tls_cert else "http",
                 self.config.host, port)
        return port

    async def stop(self) -> None:
        self.router.console.close()          # endless streams would hold the shutdown up
        await self.kept_responses.background.stop()
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            with contextlib.suppress(BaseException):
                await self.task
