"""`python -m services.tools.healthcheck` (the containers' healthcheck): exit 0 only for SERVING, 1 with a
one-line reason for NOT_SERVING, an unknown service, or nothing listening."""
from __future__ import annotations

import socket
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.tools.healthcheck import main

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def health_server():
    """A real gRPC server on a free loopback port with the stock health service; yields
    (address, servicer)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


def test_serving_exits_0(health_server, capsys):
    address, servicer = health_server
    servicer.set("", SERVING)
    assert main([address]) == 0
    assert capsys.readouterr().out.strip() == f"{address}: SERVING"


def test_not_serving_exits_1(health_server, capsys):
    address, servicer = health_server
    servicer.set("", NOT_SERVING)
    assert main([address]) == 1
    assert capsys.readouterr().err.strip() == f"{address}: NOT_SERVING"


def test_named_service(health_server, capsys):
    address, servicer = health_server
    servicer.set("qos.v1.Router", SERVING)
    assert main([address, "--service", "qos.v1.Router"]) == 0
    assert main([address, "--service", "qos.v1.Nothing"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_nothing_listening_exits_1_quickly(capsys):
    with socket.socket() as sock:           # a port that was free a moment ago and is closed now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    assert main([f"127.0.0.1:{port}", "--timeout", "5"]) == 1
    assert time.monotonic() - started < 2.0   # refused at once, not after the timeout
    message = capsys.readouterr().err.strip()
    assert message.startswith(f"127.0.0.1:{port}: UNAVAILABLE") and "\n" not in message
