"""The Router's gRPC front: Generate (parse the metadata, then the shared request path:
services/router/request_path.py) and Stats; the HTTP front beside it (http_front.py); both drain
on SIGTERM.

Errors are ServiceErrors, mapped to gRPC statuses by the server's interceptor.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.config import PoolConfig, RouterConfig
from services.common.drain import Drain
from services.common.errors import ServiceError
from services.common.grpc_server import run_server
from services.common.metrics import serve_metrics
from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.common.tracing import extract_metadata, setup_tracing, shutdown_tracing
from services.router.http_front import HttpFront
from services.router.pools import PoolDirectory
from services.router.request_path import RequestPath
from services.router.tally import RouterTotals
from services.router.validation import decode_request, parse_head

log = logging.getLogger(__name__)


class RouterService:
    def __init__(self, pools: list[PoolConfig], model_name: str, routing: str = "cost",
                 admission: str = "priority", drain: Drain | None = None, migration_limit: int = 3):
        self.pools = PoolDirectory(pools, model_name, routing)
        self.totals = RouterTotals(list(self.pools.handles))
        self.tracer = setup_tracing("router")
        self.path = RequestPath(self.pools, self.totals, self.tracer, model_name, admission,
                                migration_limit)
        self.drain = drain or Drain("router")
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.pools.start()
        self.tasks = [asyncio.create_task(self.path.admissions.run())]

    async def stop(self) -> None:
        """After the drain: the admission task and the pools' channels go."""
        for task in self.tasks:
            task.cancel()
        await self.pools.close()

    async def Generate(self, raw: router_pb2.GenerateRequestBytes, context: grpc.aio.ServicerContext):
        metadata = context.invocation_metadata() or ()
        try:
            self.drain.check()
            head = parse_head(dict(metadata))
        except ServiceError as refused:
            self.totals.refused_early(refused)
            raise
        with self.drain.track():
            async for chunk in self.path.serve(head, lambda max_context: decode_request(raw, max_context),
                                               extract_metadata(metadata)):
                yield chunk

    async def Stats(self, request, context) -> router_pb2.RouterStats:
        return self.totals.stats_proto(self.pools.latest_stats(), self.pools.router.threshold.value)


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
    """The router: gRPC on [router] port, the OpenAI-compatible HTTP front on http_port (unless
    -1), both on one request path, drained together on SIGTERM."""
    service = RouterService(pools, model_name, config.routing, config.admission,
                            Drain("router", config.drain_seconds), config.migration_limit)
    http = HttpFront(service, config) if config.http_port >= 0 else None
    serve_metrics(service.totals.registry, config.host, config.metrics_port, "router")

    async def started(_port: int) -> None:
        await service.start()
        if http is not None:
            await http.start()

    async def stopping() -> None:
        if http is not None:
            await http.stop()
        await service.stop()

    await run_server("router", config.address, lambda server: register_router(server, service),
                     service.drain, on_started=started, on_stopping=stopping,
                     ready=service.pools.ready)
    shutdown_tracing()
