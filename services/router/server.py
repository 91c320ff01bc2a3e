"""The Router gRPC service: validate, classify by `x-priority`, forward to the pool's scheduler,
relay the stream, keep per-priority stats."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque

import grpc

from services.common.config import RouterConfig
from services.common.grpc_server import CHANNEL_OPTIONS, run_server
from services.common.priority import (ORDER, PRIORITY_HEADER, SLO_HEADER, TENANT_HEADER,
                                      parse_priority, parse_slo_ms)
from services.common.proto.qos.v1 import (common_pb2, router_pb2, router_pb2_grpc, scheduler_pb2,
                                          scheduler_pb2_grpc)
from services.router.validation import InvalidRequest, decode_request

log = logging.getLogger(__name__)

LATENCY_WINDOW = 10_000        # most recent requests per priority kept for percentiles
RELAYED_TRAILERS = ("retry-after-ms",)


def percentile(values, q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class PriorityCounters:
    def __init__(self) -> None:
        self.requests = self.completed = self.failed = self.cancelled = self.output_tokens = 0
        self.ttft_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.e2e_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)

    def to_proto(self, priority: int) -> router_pb2.PriorityStats:
        return router_pb2.PriorityStats(
            priority=priority, requests=self.requests, completed=self.completed, failed=self.failed,
            cancelled=self.cancelled, output_tokens=self.output_tokens,
            ttft_p50_ms=percentile(self.ttft_ms, 0.50), ttft_p95_ms=percentile(self.ttft_ms, 0.95),
            ttft_p99_ms=percentile(self.ttft_ms, 0.99), e2e_p50_ms=percentile(self.e2e_ms, 0.50),
            e2e_p95_ms=percentile(self.e2e_ms, 0.95), e2e_p99_ms=percentile(self.e2e_ms, 0.99))


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, scheduler_address: str):
        self.scheduler_address = scheduler_address
        self.channel = grpc.aio.insecure_channel(scheduler_address, options=CHANNEL_OPTIONS)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.pool_stats: scheduler_pb2.PoolStats | None = None
        self.counters = {p: PriorityCounters() for p in ORDER}
        self.watch_task: asyncio.Task | None = None
        self.knows_pool = asyncio.Event()   # health says SERVING only once the pool is known

    async def start(self) -> None:
        self.watch_task = asyncio.create_task(self._watch_pool())

    async def stop(self) -> None:
        if self.watch_task:
            self.watch_task.cancel()
        await self.channel.close()

    async def _watch_pool(self) -> None:
        """Cache the pool's stats (model, context window, load): the request path reads only this."""
        while True:
            try:
                async for stats in self.scheduler.WatchPoolStats(
                        scheduler_pb2.PoolStatsRequest(interval_ms=500)):
                    self.pool_stats = stats
                    if stats.max_context:   # a worker has connected: the model's limits are known
                        self.knows_pool.set()
            except grpc.aio.AioRpcError as exc:
                log.debug("pool stats stream from %s: %s", self.scheduler_address, exc.code().name)
            await asyncio.sleep(0.2)

    async def Generate(self, raw: router_pb2.GenerateRequestBytes, context: grpc.aio.ServicerContext):
        received = time.perf_counter()
        metadata = dict(context.invocation_metadata() or ())
        try:
            priority = parse_priority(metadata.get(PRIORITY_HEADER))
            slo_ms = parse_slo_ms(metadata.get(SLO_HEADER))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        counters = self.counters[priority]
        counters.requests += 1
        stats = self.pool_stats
        max_context = stats.max_context if stats and stats.max_context else None
        try:
            request = decode_request(raw, max_context)
        except InvalidRequest as exc:
            counters.failed += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.model and stats and request.model != stats.model:
            counters.failed += 1
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"model {request.model!r} is not served by any pool "
                                f"(pool {stats.pool} serves {stats.model!r})")
        submit = scheduler_pb2.SubmitRequest(
            request_id=uuid.uuid4().hex, priority=priority, tenant=metadata.get(TENANT_HEADER, ""),
            prompt=request.prompt, messages=request.messages, sampling=request.sampling,
            slo_ms=slo_ms)
        call = self.scheduler.Submit(submit)
        first = True
        finished = False
        try:
            async for chunk in call:
                if first and chunk.token_ids:
                    counters.ttft_ms.append((time.perf_counter() - received) * 1000)
                    first = False
                counters.output_tokens += len(chunk.token_ids)
                if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    finished = True
                    counters.completed += 1
                    counters.e2e_ms.append((time.perf_counter() - received) * 1000)
                yield chunk
        except grpc.aio.AioRpcError as exc:
            counters.failed += 1
            finished = True
            trailers = tuple((k, v) for k, v in (exc.trailing_metadata() or ()) if k in RELAYED_TRAILERS)
            if trailers:
                context.set_trailing_metadata(trailers)
            details = exc.details() or ""
            if exc.code() == grpc.StatusCode.UNAVAILABLE and "worker" not in details:
                # Not a status the scheduler sent: the scheduler itself could not be reached.
                details = f"scheduler {self.scheduler_address} unavailable: {details}"
            await context.abort(exc.code(), details)
        finally:
            if not finished:
                counters.cancelled += 1
                call.cancel()   # the client went away: cancel the chain behind us

    async def Stats(self, request, context) -> router_pb2.RouterStats:
        return router_pb2.RouterStats(priorities=[self.counters[p].to_proto(p) for p in ORDER],
                                      pools=[self.pool_stats] if self.pool_stats else [])


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


async def serve_router(config: RouterConfig, scheduler_address: str) -> None:
    service = RouterService(scheduler_address)

    async def started(_port: int) -> None:
        await service.start()

    await run_server("router", config.address, lambda server: register_router(server, service),
                     on_started=started, on_stopping=service.stop, ready=service.knows_pool)
