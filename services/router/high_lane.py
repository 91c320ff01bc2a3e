"""The High lane: a gRPC port of the router's own for real-time (High) requests.

Why a port of its own: grpc.aio's server accepts calls one at a time, each acceptance taking a
turn of the event loop (it asks gRPC core for the next call only once the last one is handed
over). When a burst's flood keeps the router's loop busy, calls arrive faster than they are
accepted, and a High call waits in gRPC core's queue behind every flood call that came before
it, before any of our code has read the class in its metadata. A second server on the same loop
accepts from a queue of its own. Measured with bench/grpc_accept.py (2026-12-04: a stand-alone
grpc.aio server, 800 calls a second with 1 ms of handler CPU each, another process busy on one of
the 2 cores): a High call's send -> handler start took a median 69.3 ms (max 208) on the flood's
port against 2.8 ms (max 4.6) on a second server; at 0.5 ms a call, a loop with room to spare,
1.1 and 1.5 ms.

The lane takes only High requests (no x-priority there means high): one that any batch could
use would queue like the main port. Anything else is the main port's: the same request path,
tenants, limits, drain and errors. gRPC only: the HTTP front accepts connections through the
event loop itself, with no such one-at-a-time step.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import grpc

from services.common.config import RouterConfig
from services.common.errors import invalid
from services.common.grpc_server import SERVER_OPTIONS, add_port
from services.common.grpc_errors import ServiceErrorInterceptor
from services.common.priority import PRIORITY_HEADER, Priority, parse_priority
from services.common.proto.qos.v1 import common_pb2, router_pb2

log = logging.getLogger(__name__)


def address_for(priority: str | None, address: str, high_address: str | None) -> str:
    """Where a client sends a `priority` request: High to the router's High lane where it has
    one (`high_address`), anything else, and High where there is no lane, to its main `address`."""
    return high_address if priority == "high" and high_address else address


def lane_metadata(metadata: Mapping[str, str], router: RouterConfig) -> dict[str, str]:
    """A lane call's metadata with its class: High when it names none; INVALID_ARGUMENT naming
    the main port for any other (a bad value is parse_head's to refuse, as on the main port)."""
    value = metadata.get(PRIORITY_HEADER)
    if value is None:
        return {**metadata, PRIORITY_HEADER: "high"}
    try:
        priority = parse_priority(value)
    except ValueError:
        return dict(metadata)
    if priority != Priority.HIGH:
        raise invalid(f"router.high_port {router.high_port} takes high-priority requests only, got "
                      f"{PRIORITY_HEADER}: {value}; send it to the router's port {router.port}",
                      field=PRIORITY_HEADER)
    return dict(metadata)


async def start_high_lane(service, router: RouterConfig, tls: tuple[str, str] | None) -> grpc.aio.Server | None:
    """The lane's server on router.high_port (None when -1), serving `service`'s Generate for
    High only; stop it once the router has drained."""
    if router.high_address is None:
        return None
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[ServiceErrorInterceptor()])
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        service.GenerateHigh, request_deserializer=router_pb2.GenerateRequestBytes.FromString,
        response_serializer=common_pb2.GenerateChunk.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("qos.v1.Router", handlers),))
    port = add_port(server, "router high lane", router.high_address, tls)
    await server.start()
    log.info("router high lane listening on %s:%d", router.host, port)
    return server
