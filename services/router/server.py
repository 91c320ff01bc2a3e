"""The Router's gRPC front: Generate (parse the metadata, then the shared request path:
services/router/request_path.py) and Stats; the HTTP front beside it (openai_api/front.py); both drain
on SIGTERM.

Errors are ServiceErrors, mapped to gRPC statuses by the server's interceptor.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import replace

import grpc
from prometheus_client import CollectorRegistry

from services.common.cluster_auth import ClusterTrust
from services.common.config import AuthConfig, ClusterConfig, RouterConfig
from services.common.drain import Drain
from services.common.errors import ErrorKind, ServiceError
from services.common.grpc_errors import abort
from services.common.grpc_server import run_server, server_options
from services.common.metrics import StateCollector, serve_metrics
from services.common.priority import PRIORITIES, TENANT_HEADER
from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.common.tracing import extract_metadata, setup_tracing, shutdown_tracing
from services.common.wire import prompt_chars
from services.control.accounts import Accounts
from services.control.console_feed import ConsoleFeed
from services.control.ledger import LedgerWriter, ledger_metrics
from services.control.limits import estimate_tokens
from services.control.process_view import ProcessView
from services.control.sla_monitor import SlaMonitor
from services.control.tenancy import Caller, TenantBook, store_metrics
from services.router.openai_api.batch_runner import BatchRunner
from services.router.openai_api.front import HttpFront
from services.router.pools import PoolDirectory
from services.router.request_path import RequestPath
from services.router.tally import RouterTotals
from services.router.validation import RequestHead, decode_request, parse_head, request_headers
from services.store.batch_store import BatchStore
from services.store.conversation_store import ConversationStore
from services.store.response_store import ResponseStore
from services.store.store import Store

log = logging.getLogger(__name__)

ROUTER_SERVICE = "qos.v1.Router"


class RouterService:
    def __init__(self, config: ClusterConfig, model_name: str, store: Store, drain: Drain | None = None):
        router, auth, billing = config.router, config.auth, config.billing
        self.router = router
        self.pools = PoolDirectory(config.pools, model_name, router.routing,
                                   ClusterTrust.load(config.security, "router"))
        registry = CollectorRegistry()
        alerts_url = f"http://{router.http_address}/v1/alerts" if router.http_address else ""
        self.sla = SlaMonitor(config.sla, config.alerts, registry, external_url=alerts_url)
        self.totals = RouterTotals(list(self.pools.handles), self.sla, registry)
        self.processes = ProcessView.from_env(registry)      # a supervised local cluster's processes
        self.tracer = setup_tracing("router")
        self.book = TenantBook(store, auth.required, auth.admin_key, auth.replicas,
                               config.store.refresh_s, config.store.stale_s, config.store.tenant_storage_mb)
        self.ledger = LedgerWriter(store, billing.flush_seconds, billing.max_pending_rows)
        registry.register(StateCollector(lambda: ledger_metrics(self.ledger)))
        registry.register(StateCollector(lambda: store_metrics(self.book)))
        self.accounts = Accounts(self.book, self.ledger, billing.multipliers, billing.cached_prompt_fraction)
        self.path = RequestPath(self.pools, self.totals, self.tracer, model_name, self.accounts,
                                router.admission, router.migration_limit, router.scheduler_link,
                                router.cache_scope)
        self.drain = drain or Drain("router")
        self.console = ConsoleFeed(self)
        # OpenAI's Batch API: files and jobs in the store, run here in the background
        self.batches, self.batch_config, self.batch_wake = BatchStore(store), config.batches, asyncio.Event()
        self.batch_runner = BatchRunner(self, self.batches, config.batches, self.batch_wake, registry)
        # OpenAI's Responses API: the answers kept for GET and previous_response_id
        self.kept_responses, self.responses_config = ResponseStore(store), config.responses
        self.conversations = ConversationStore(store)
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.book.refresh()          # keys and tenants known before the first request
        if self.book.shared:
            await self.book.exchange_shares()     # ... and this replica's shares of their limits
        self.pools.start()
        self.tasks = [asyncio.create_task(self.path.admissions.run()),
                      asyncio.create_task(self.book.keep_fresh()),
                      asyncio.create_task(self.ledger.run()),
                      asyncio.create_task(self.sla.run()),
                      asyncio.create_task(self.console.run()),
                      asyncio.create_task(self.batch_runner.run())]
        if self.book.shared:
            self.tasks.append(asyncio.create_task(self.book.keep_shared()))

    async def stop(self) -> None:
        """After the drain: the background tasks and the pools' channels go, the ledger's last
        rows are written."""
        for task in self.tasks:
            task.cancel()
        await self.ledger.flush()
        await self.book.release_shares()
        await self.sla.webhooks.flush()
        await self.pools.close()
        self.book.store.close()

    def identify(self, metadata: Mapping[str, str]) -> Caller:
        """Both fronts, first, before anything of the request's body is read: refused while
        draining, then the caller from its key (with auth off, a request without one is the tenant
        its x-tenant names)."""
        self.drain.check()
        return self.book.authenticate(metadata.get("authorization"), metadata.get(TENANT_HEADER, ""))

    def let_in(self, metadata: Mapping[str, str], caller: Caller) -> RequestHead:
        """The head from the metadata (headers); the caller's tenant and weight ride along to the
        scheduler."""
        head = parse_head(metadata)
        return replace(head, tenant=caller.name, tenant_weight=caller.tenant.weight)

    async def Generate(self, raw: router_pb2.GenerateRequestBytes, context: grpc.aio.ServicerContext):
        metadata = context.invocation_metadata() or ()
        try:
            headers = request_headers(metadata, self.book.required)
            caller = self.identify(headers)
            head = self.let_in(headers, caller)
        except ServiceError as refused:
            self.totals.refused_early(refused)
            raise
        estimate = estimate_tokens(prompt_chars(raw),
                                   raw.sampling.max_tokens if raw.sampling.HasField("max_tokens") else None)
        with self.drain.track():
            async for chunk in self.path.serve(head, lambda max_context: decode_request(raw, max_context),
                                               caller, estimate, extract_metadata(metadata)):
                yield chunk

    def _caller(self, context) -> Caller:
        metadata = request_headers(context.invocation_metadata() or (), self.book.required)
        return self.book.authenticate(metadata.get("authorization"), metadata.get(TENANT_HEADER, ""))

    async def Stats(self, request, context) -> router_pb2.RouterStats:
        caller = self._caller(context)
        if self.book.required and not caller.admin:
            raise ServiceError(ErrorKind.PERMISSION_DENIED, "the router's stats cover every tenant: "
                               "they need the admin key", field="authorization", reason="admin_only")
        return self.totals.stats_proto(self.pools.latest_stats(), self.pools.router.threshold.value)

    async def Alerts(self, request, context) -> router_pb2.AlertsReply:
        return self.sla.reply_to(self._caller(context), self.book.required)

    async def Usage(self, request: router_pb2.UsageRequest, context) -> router_pb2.UsageReply:
        usage = await self.accounts.usage(self._caller(context), request.tenant or None,
                                          request.since_unix_s or None, since_field="since_unix_s")
        lines = [router_pb2.UsageLine(**{**line, "priority": PRIORITIES[line["priority"]]})
                 for line in usage.pop("lines")]
        usage.pop("since")
        if usage["storage_limit_bytes"] is None:
            usage.pop("storage_limit_bytes")
        return router_pb2.UsageReply(lines=lines, **usage)

    async def Cancel(self, request: router_pb2.CancelRequest, context) -> router_pb2.CancelReply:
        entry = self.accounts.cancel(self._caller(context), request.request_id)
        return router_pb2.CancelReply(request_id=entry.request_id, tenant=entry.tenant)


class CallerGate(grpc.aio.ServerInterceptor):
    """The router's public gRPC server, auth on: a Router call without a valid key is refused from
    its metadata when it starts, before gRPC reads its request message (as the HTTP front answers
    before reading the body). Health checks pass; the handlers still identify every caller."""

    def __init__(self, service: RouterService):
        self.service = service

    async def intercept_service(self, continuation, details):
        if self.service.book.required and details.method.startswith(f"/{ROUTER_SERVICE}/"):
            try:
                metadata = request_headers(details.invocation_metadata or ())
                self.service.book.authenticate(metadata.get("authorization"))
            except ServiceError as refused:
                if details.method == f"/{ROUTER_SERVICE}/Generate":
                    self.service.totals.refused_early(refused)
                return _refusal(refused)
        return await continuation(details)


def _refusal(error: ServiceError) -> grpc.RpcMethodHandler:
    async def refuse(_requests, context):      # a request-streaming handler: the message is never read
        await abort(context, error)
    return grpc.stream_unary_rpc_method_handler(refuse)


def front_options(router: RouterConfig) -> list[tuple[str, int]]:
    """The public server takes messages no larger than the HTTP front takes bodies; the hops
    inside the cluster keep their 64 MiB."""
    return [(name, router.http_max_body_bytes if name == "grpc.max_receive_message_length" else value)
            for name, value in server_options()]


def register_router(server: grpc.aio.Server, service: RouterService) -> list[str]:
    # Generate is registered by hand to parse requests with their bytes twin: invalid UTF-8 then
    # reaches our validation (INVALID_ARGUMENT naming the field) instead of failing in protobuf.
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=router_pb2.GenerateRequestBytes.FromString,
            response_serializer=common_pb2.GenerateChunk.SerializeToString),
        "Stats": grpc.unary_unary_rpc_method_handler(
            service.Stats, request_deserializer=router_pb2.StatsRequest.FromString,
            response_serializer=router_pb2.RouterStats.SerializeToString),
        "Usage": grpc.unary_unary_rpc_method_handler(
            service.Usage, request_deserializer=router_pb2.UsageRequest.FromString,
            response_serializer=router_pb2.UsageReply.SerializeToString),
        "Cancel": grpc.unary_unary_rpc_method_handler(
            service.Cancel, request_deserializer=router_pb2.CancelRequest.FromString,
            response_serializer=router_pb2.CancelReply.SerializeToString),
        "Alerts": grpc.unary_unary_rpc_method_handler(
            service.Alerts, request_deserializer=router_pb2.AlertsRequest.FromString,
            response_serializer=router_pb2.AlertsReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ROUTER_SERVICE, handlers),))
    return [ROUTER_SERVICE]


async def serve_router(config: ClusterConfig, model_name: str) -> None:
    """The router: gRPC on [router] port, the OpenAI-compatible HTTP front on http_port (unless
    -1), both on one request path, drained together on SIGTERM."""
    router = config.router
    store = await asyncio.to_thread(Store, config.store.url or None, config.store.connect_timeout_s,
                                    config.store.statement_timeout_s)
    service = RouterService(config, model_name, store, Drain("router", router.drain_seconds))
    http = HttpFront(service, router) if router.http_port >= 0 else None
    serve_metrics(service.totals.registry, router.host, router.metrics_port, "router")
    warn_if_keys_in_clear(router, config.auth)

    async def started(_port: int) -> None:
        await service.start()
        if http is not None:
            await http.start()

    async def stopping() -> None:
        if http is not None:
            await http.stop()
        await service.stop()

    await run_server("router", router.address, lambda server: register_router(server, service),
                     service.drain, on_started=started, on_stopping=stopping,
                     ready=service.pools.ready, tls=tls_files(router), options=front_options(router),
                     gates=[CallerGate(service)])
    shutdown_tracing()


def tls_files(router: RouterConfig) -> tuple[str, str] | None:
    return (router.tls_cert, router.tls_key) if router.tls_cert else None


def warn_if_keys_in_clear(router: RouterConfig, auth: AuthConfig) -> None:
    if auth.required and not router.tls_cert and router.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("auth is required but TLS is off on %s: API keys travel in the clear; set "
                    "[router] tls_cert and tls_key", router.host)
