"""The Router gRPC service: validate, classify by `x-priority`, choose a pool by cost and load
(services/router/routing.py, from cached pool stats only), forward to its scheduler, relay the
stream with the cost charged, keep stats per priority, pool and tenant."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque

import grpc

from services.common.config import PoolConfig, RouterConfig
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry

from services.common.grpc_server import CHANNEL_OPTIONS, run_server
from services.common.metrics import RequestMetrics, serve_metrics
from services.common.percentile import percentile
from services.common.tracing import extract_metadata, inject_metadata, setup_tracing, shutdown_tracing
from services.common.priority import (LORA_HEADER, ORDER, PRIORITY_HEADER, SLO_HEADER,
                                      TENANT_HEADER, parse_priority, parse_slo_ms, priority_name)
from services.common.intake import PriorityIntake
from services.common.proto.qos.v1 import (common_pb2, router_pb2, router_pb2_grpc, scheduler_pb2,
                                          scheduler_pb2_grpc)
from services.router.routing import NoPoolError, PoolLoad, PoolRouter, PoolSpec, RouteRequest
from services.router.validation import InvalidRequest, decode_request

log = logging.getLogger(__name__)

LATENCY_WINDOW = 10_000        # most recent requests per priority kept for percentiles
RELAYED_TRAILERS = ("retry-after-ms",)
POOL_GRACE_S = 5.0             # how long the router waits for every pool before serving without some


async def _go_ahead(_request) -> None:
    """The router's admission step: nothing to compute, only the turn (priority order) matters."""


class Counters:
    """Requests, tokens, cost and latency samples for one priority, pool or tenant."""

    def __init__(self) -> None:
        self.requests = self.completed = self.failed = self.cancelled = self.output_tokens = 0
        self.cost_units = 0.0
        self.ttft_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.e2e_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)

    def to_priority_proto(self, priority: int) -> router_pb2.PriorityStats:
        return router_pb2.PriorityStats(
            priority=priority, requests=self.requests, completed=self.completed, failed=self.failed,
            cancelled=self.cancelled, output_tokens=self.output_tokens, cost_units=self.cost_units,
            ttft_p50_ms=percentile(self.ttft_ms, 0.50), ttft_p95_ms=percentile(self.ttft_ms, 0.95),
            ttft_p99_ms=percentile(self.ttft_ms, 0.99), e2e_p50_ms=percentile(self.e2e_ms, 0.50),
            e2e_p95_ms=percentile(self.e2e_ms, 0.95), e2e_p99_ms=percentile(self.e2e_ms, 0.99))

    def to_group_proto(self, name: str) -> router_pb2.GroupStats:
        return router_pb2.GroupStats(
            name=name, requests=self.requests, completed=self.completed, failed=self.failed,
            output_tokens=self.output_tokens, cost_units=self.cost_units,
            ttft_p50_ms=percentile(self.ttft_ms, 0.50), ttft_p99_ms=percentile(self.ttft_ms, 0.99),
            e2e_p99_ms=percentile(self.e2e_ms, 0.99))


class PoolHandle:
    """One pool as the router sees it: its scheduler stub and its latest stats."""

    def __init__(self, config: PoolConfig):
        self.config = config
        self.channel = grpc.aio.insecure_channel(config.scheduler.address, options=CHANNEL_OPTIONS)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.stats: scheduler_pb2.PoolStats | None = None


def pool_load(stats: scheduler_pb2.PoolStats) -> PoolLoad:
    total = stats.kv_blocks_total or 1
    return PoolLoad(healthy=stats.workers > 0, queued=sum(c.waiting for c in stats.classes),
                    free_kv=1.0 - stats.kv_blocks_used / total, ttft_ms=stats.ttft_p90_ms,
                    utilization=stats.utilization)


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, pools: list[PoolConfig], model_name: str, routing: str = "cost",
                 admission: str = "priority"):
        self.model_name = model_name
        self.pools = {p.name: PoolHandle(p) for p in pools}
        self.routing = PoolRouter([PoolSpec(p.name, p.device, frozenset({model_name}),
                                            p.cost_per_token, p.lora, p.primary) for p in pools],
                                  mode=routing)
        self.specs = {spec.name: spec for spec in self.routing.pools}
        self.by_priority = {p: Counters() for p in ORDER}
        self.by_pool = {name: Counters() for name in self.pools}
        self.by_tenant: dict[str, Counters] = {}
        self.watch_tasks: list[asyncio.Task] = []
        self.registry = CollectorRegistry()
        self.metrics = RequestMetrics(self.registry, ("priority", "pool"))
        # Requests go on to validation and their pool in priority order (services/common/intake.py).
        self.admissions = PriorityIntake(_go_ahead, by_priority=admission == "priority")
        self.knows_pools = asyncio.Event()   # health says SERVING once the pools are known
        self.tracer = setup_tracing("router")

    async def start(self) -> None:
        self.watch_tasks = [asyncio.create_task(self._watch_pool(h)) for h in self.pools.values()]
        self.watch_tasks.append(asyncio.create_task(self._serve_without_missing_pools()))
        self.watch_tasks.append(asyncio.create_task(self.admissions.run()))

    async def _serve_without_missing_pools(self) -> None:
        """Ready at once when every pool answers; after POOL_GRACE_S, ready with those that do.
        A pool that is down (or not started, as in docker compose without its profile) is
        unhealthy and gets no requests until it answers."""
        while not self.knows_pools.is_set():
            await asyncio.sleep(POOL_GRACE_S)
            known = [n for n, h in self.pools.items() if h.stats is not None and h.stats.max_context]
            if known and not self.knows_pools.is_set():
                missing = sorted(set(self.pools) - set(known))
                log.warning("serving with pool(s) %s; no answer yet from %s", ", ".join(known),
                            ", ".join(missing))
                self.knows_pools.set()

    async def stop(self) -> None:
        for task in self.watch_tasks:
            task.cancel()
        for handle in self.pools.values():
            await handle.channel.close()

    async def _watch_pool(self, handle: PoolHandle) -> None:
        """Cache a pool's stats (model, limits, load): the request path reads only this."""
        name = handle.config.name
        while True:
            try:
                async for stats in handle.scheduler.WatchPoolStats(
                        scheduler_pb2.PoolStatsRequest(interval_ms=200)):
                    if stats.device and stats.device != handle.config.device:
                        log.error("pool %s is configured as %s but its workers run on %s; not routing "
                                  "to it", name, handle.config.device, stats.device)
                        self.routing.update(name, PoolLoad(healthy=False))
                        continue
                    handle.stats = stats
                    self.routing.update(name, pool_load(stats))
                    if all(h.stats is not None and h.stats.max_context for h in self.pools.values()):
                        self.knows_pools.set()
            except grpc.aio.AioRpcError as exc:
                log.debug("pool %s stats stream: %s", name, exc.code().name)
            self.routing.update(name, PoolLoad(healthy=False))
            await asyncio.sleep(0.2)

    def _max_context(self) -> int | None:
        known = [h.stats.max_context for h in self.pools.values() if h.stats and h.stats.max_context]
        return min(known) if known else None

    async def Generate(self, raw: router_pb2.GenerateRequestBytes, context: grpc.aio.ServicerContext):
        span = self.tracer.start_span("router.generate", kind=SpanKind.SERVER,
                                      context=extract_metadata(context.invocation_metadata()))
        try:
            async for chunk in self._generate(raw, context, span):
                yield chunk
        finally:
            span.end()

    async def _generate(self, raw, context: grpc.aio.ServicerContext, span):
        received = time.perf_counter()
        metadata = dict(context.invocation_metadata() or ())
        try:
            priority = parse_priority(metadata.get(PRIORITY_HEADER))
            slo_ms = parse_slo_ms(metadata.get(SLO_HEADER))
        except ValueError as exc:
            self.metrics.rejections.labels("unknown", "invalid_argument").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        tenant = metadata.get(TENANT_HEADER, "")
        await self.admissions.admit(None, priority)
        name = priority_name(priority)
        span.set_attributes({"qos.priority": name, "qos.tenant": tenant})
        groups = [self.by_priority[priority], self.by_tenant.setdefault(tenant, Counters())]
        for group in groups:
            group.requests += 1
        try:
            request = decode_request(raw, self._max_context())
        except InvalidRequest as exc:
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            for group in groups:
                group.failed += 1
            self.metrics.rejections.labels(name, "invalid_argument").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        lora = metadata.get(LORA_HEADER) or None
        parent = trace.set_span_in_context(span)
        route_span = self.tracer.start_span("router.route", context=parent)
        try:
            decision = self.routing.route(RouteRequest(request.model or self.model_name, priority,
                                                       lora, slo_ms or None))
        except NoPoolError as exc:
            route_span.set_status(Status(StatusCode.ERROR, str(exc)))
            route_span.end()
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            for group in groups:
                group.failed += 1
            self.metrics.rejections.labels(name, "no_pool").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        route_span.set_attributes({"qos.pool": decision.pool, "qos.route.rule": decision.rule,
                                   "qos.route.threshold": self.routing.threshold.value,
                                   **{f"qos.route.queued.{n}": l.queued for n, l in self.routing.loads.items()},
                                   **{f"qos.route.free_kv.{n}": l.free_kv for n, l in self.routing.loads.items()}})
        route_span.end()
        span.set_attribute("qos.pool", decision.pool)
        pool = self.pools[decision.pool]
        self.routing.note_dispatch(decision.pool)
        groups.append(self.by_pool[decision.pool])
        self.by_pool[decision.pool].requests += 1
        submit = scheduler_pb2.SubmitRequest(
            request_id=uuid.uuid4().hex, priority=priority, tenant=tenant, prompt=request.prompt,
            messages=request.messages, sampling=request.sampling, slo_ms=slo_ms, lora=lora or "")
        call = pool.scheduler.Submit(submit, metadata=inject_metadata(parent))
        first, first_token_s = True, 0.0
        finished = False
        try:
            async for chunk in call:
                elapsed_ms = (time.perf_counter() - received) * 1000
                for group in groups:
                    group.output_tokens += len(chunk.token_ids)
                    if first and chunk.token_ids:
                        group.ttft_ms.append(elapsed_ms)
                if first and chunk.token_ids:
                    first_token_s = elapsed_ms / 1000
                self.metrics.tokens.labels(name, decision.pool).inc(len(chunk.token_ids))
                first = first and not chunk.token_ids
                if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    finished = True
                    chunk.cost_units = (chunk.usage.prompt_tokens + chunk.usage.completion_tokens) \
                        * self.specs[decision.pool].cost
                    for group in groups:
                        group.completed += 1
                        group.e2e_ms.append(elapsed_ms)
                        group.cost_units += chunk.cost_units
                    self.metrics.finished((name, decision.pool), first_token_s, elapsed_ms / 1000,
                                          chunk.usage.completion_tokens)
                    span.set_attributes({"qos.prompt_tokens": chunk.usage.prompt_tokens,
                                         "qos.output_tokens": chunk.usage.completion_tokens,
                                         "qos.cost_units": chunk.cost_units,
                                         "qos.ttft_ms": first_token_s * 1000})
                yield chunk
        except grpc.aio.AioRpcError as exc:
            finished = True
            for group in groups:
                group.failed += 1
            span.set_status(Status(StatusCode.ERROR, f"{exc.code().name}: {exc.details()}"))
            self.metrics.requests.labels(name, decision.pool, "failed").inc()
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.metrics.rejections.labels(name, "resource_exhausted").inc()
            trailers = tuple((k, v) for k, v in (exc.trailing_metadata() or ()) if k in RELAYED_TRAILERS)
            if trailers:
                context.set_trailing_metadata(trailers)
            details = exc.details() or ""
            if exc.code() == grpc.StatusCode.UNAVAILABLE and "worker" not in details:
                # Not a status the scheduler sent: the scheduler itself could not be reached.
                details = f"pool {decision.pool} scheduler {pool.config.scheduler.address} " \
                          f"unavailable: {details}"
            await context.abort(exc.code(), details)
        finally:
            if not finished:
                self.metrics.requests.labels(name, decision.pool, "cancelled").inc()
                for group in groups:
                    group.cancelled += 1
                call.cancel()   # the client went away: cancel the chain behind us

    async def Stats(self, request, context) -> router_pb2.RouterStats:
        return router_pb2.RouterStats(
            priorities=[self.by_priority[p].to_priority_proto(p) for p in ORDER],
            pools=[h.stats for h in self.pools.values() if h.stats is not None],
            by_pool=[c.to_group_proto(name) for name, c in self.by_pool.items()],
            by_tenant=[c.to_group_proto(name) for name, c in sorted(self.by_tenant.items())],
            overflow_threshold=self.routing.threshold.value)


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
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("qos.v1.Router", handlers),))
    return ["qos.v1.Router"]


async def serve_router(config: RouterConfig, pools: list[PoolConfig], model_name: str) -> None:
    service = RouterService(pools, model_name, config.routing, config.admission)
    serve_metrics(service.registry, config.host, config.metrics_port, "router")

    async def started(_port: int) -> None:
        await service.start()

    await run_server("router", config.address, lambda server: register_router(server, service),
                     on_started=started, on_stopping=service.stop, ready=service.knows_pools)
    shutdown_tracing()
