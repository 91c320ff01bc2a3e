"""A stream that waits long for its first message (a request deep in a queue) must survive the
client's keepalive pings: our servers accept them (services/common/grpc_server.py). Scaled down:
pings every 100 ms instead of 10 s, so the default server's "too many pings" shows in seconds."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import channel_options, server_options

KEEPALIVE_MS = 100
WAIT_S = 8.0                 # the default server hung up after ~4 s of this
# Both ends ping at the keepalive rate even on a stream without data (gRPC's own pacing takes
# minutes to reach the server's limit); the servers below differ only in what server_options adds.
EAGER_PINGS = [("grpc.http2.max_pings_without_data", 0),
               ("grpc.http2.min_time_between_pings_ms", KEEPALIVE_MS)]
EAGER_CLIENT = channel_options(KEEPALIVE_MS) + EAGER_PINGS


class SlowFirstMessage(health_pb2_grpc.HealthServicer):
    async def Watch(self, request, context):
        await asyncio.sleep(WAIT_S)
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def wait_for_first_message(options) -> str:
    server = grpc.aio.server(options=options)
    health_pb2_grpc.add_HealthServicer_to_server(SlowFirstMessage(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=EAGER_CLIENT) as channel:
            try:
                async for _ in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()):
                    return "OK"
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
    finally:
        await server.stop(0)
    return "no message"


def test_our_servers_keep_a_quiet_stream_alive_under_keepalive_pings():
    assert asyncio.run(wait_for_first_message(server_options(KEEPALIVE_MS) + EAGER_PINGS)) == "OK"


@pytest.mark.slow
def test_a_server_with_default_ping_policy_hangs_up_on_the_same_stream():
    """The control: the options our servers had before (the channel's alone) lose the stream."""
    result = asyncio.run(wait_for_first_message(channel_options(KEEPALIVE_MS) + EAGER_PINGS))
    assert result == "UNAVAILABLE: Too many pings"


async def bind_twice(options) -> tuple[int, int]:
    """The port a first server got, and what a second server asking for the same one got (0 or
    an error: it could not bind)."""
    first, second = grpc.aio.server(options=options), grpc.aio.server(options=options)
    port = first.add_insecure_port("127.0.0.1:0")
    await first.start()
    try:
        try:
            again = second.add_insecure_port(f"127.0.0.1:{port}")
        except RuntimeError:
            again = 0
        return port, again
    finally:
        await first.stop(0)
        await second.stop(0)


def test_a_second_server_cannot_take_a_port_in_use():
    """With gRPC's default SO_REUSEPORT both would listen and split the connections between them
    (a scheduler's calls reaching a worker: "Method not found")."""
    port, again = asyncio.run(bind_twice(server_options()))
    assert port > 0 and again == 0
    port, again = asyncio.run(bind_twice(channel_options()))        # the control: gRPC's default
    assert again == port
