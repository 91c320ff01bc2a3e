"""Clients that stop sending are let go (services/router/openai_api/timeouts.py): a connection that
sends nothing, one that stops inside its headers and one that stops inside its body were held for
ever; now each is closed after [router] http_read_timeout_s (the last two with a 408 saying why),
and so is one sending stray bytes after a response; a client sending at its own pace meanwhile is
served. A real cluster, HTTP front."""
from __future__ import annotations

import json
import socket
import time

import pytest

from services.local.cluster import LocalCluster
from tests.e2e.conftest import bench_model, cluster_config

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster():
    config = cluster_config(model=bench_model(), dtype="fp32")
    config.router.http_read_timeout_s = TIMEOUT_S
    with LocalCluster(config, quiet=True) as running:
        yield running


def connect(cluster) -> socket.socket:
    router = cluster.config.router
    sock = socket.create_connection((router.host, router.http_port), timeout=30)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took."""
    started, received = time.monotonic(), b""
    while True:
        piece = sock.recv(65536)
        if not piece:
            return received, time.monotonic() - started
        received += piece


def body_of(reply: bytes) -> dict:
    return json.loads(reply.split(b"\r\n\r\n", 1)[1])


def test_a_connection_that_sends_nothing_is_closed(cluster):
    with connect(cluster) as sock:
        reply, waited = read_until_closed(sock)
    assert reply == b"" and waited < TIMEOUT_S + 10


def test_headers_that_stop_midway_get_408_and_a_close(cluster):
    with connect(cluster) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        reply, waited = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and waited < TIMEOUT_S + 10
    assert body_of(reply)["error"]["code"] == "request_timeout"


def test_a_body_that_stops_midway_gets_408_naming_it(cluster):
    with connect(cluster) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        reply, waited = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and waited < TIMEOUT_S + 10
    error = body_of(reply)["error"]
    assert error["param"] == "body" and "http_read_timeout_s" in error["message"]


def test_a_body_that_stops_midway_gets_408_and_the_connection_is_closed(cluster):
    """Its 408 kept the connection alive: the rest of the body, arriving later, was then held."""
    with connect(cluster) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        reply, waited = read_until_closed(sock)
    assert b"\r\nconnection: close\r\n" in reply.lower() and waited < TIMEOUT_S + 10


def test_bytes_after_a_response_do_not_hold_the_connection(cluster):
    """uvicorn's keep-alive timer is cancelled by any byte: a bare CRLF after a response, or a
    pipelined request's first half, left the connection with no timer at all."""
    for tail in (b"\r\n", b"GET /health HTTP/1.1\r\nHo"):
        with connect(cluster) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = sock.recv(65536)            # the response: uvicorn's keep-alive timer is armed
            sock.sendall(tail)                  # ... and cancelled by these bytes
            reply, waited = read_until_closed(sock)
        assert first.startswith(b"HTTP/1.1 200 ") and waited < TIMEOUT_S + 10, tail


def test_a_slow_but_steady_client_is_served(cluster):
    """Pauses shorter than the timeout, several of them: longer in all than the timeout."""
    body = json.dumps({"model": bench_model().rsplit("/", 1)[-1], "prompt": "Hello there", "max_tokens": 2}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
    with connect(cluster) as sock:
        sock.sendall(head)
        for i in range(0, len(body), len(body) // 3 + 1):
            time.sleep(TIMEOUT_S * 0.6)
            sock.sendall(body[i:i + len(body) // 3 + 1])
        reply, _ = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:300]
