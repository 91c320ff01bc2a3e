"""The HTTP front when things go wrong: an oversized body (413, read even by a client still
sending), a full queue (429 with Retry-After), a client that disconnects mid-stream (its KV
blocks come back), a worker killed mid-stream (a final SSE error event, never a hang), no worker
left (503 with Retry-After).

Raw HTTP/1.0 over asyncio streams, so the test sees exactly what is on the wire and can hang up
at any moment. One small pool: 1 running sequence, 1 waiting per class."""
from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from services.common.proto.qos.v1 import scheduler_pb2
from services.local.cluster import LocalCluster
from tests.e2e.conftest import cluster_config, run

pytestmark = pytest.mark.slow

BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def cluster():
    config = cluster_config(max_running=1, max_queue=1, retry_after_ms=1500, orphan_grace_s=1.0)
    config.router.http_max_body_bytes = BODY_LIMIT
    with LocalCluster(config, quiet=True) as running:
        yield running


class Exchange:
    """One HTTP/1.0 request: status, headers, then the body line by line (SSE events)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.status, self.headers = 0, {}

    @classmethod
    async def post(cls, cluster, path: str, body, headers: dict | None = None) -> "Exchange":
        router = cluster.config.router
        reader, writer = await asyncio.open_connection(router.host, router.http_port)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in {"content-type": "application/json",
                                                     "content-length": len(data), **(headers or {})}.items())
        writer.write(f"POST {path} HTTP/1.0\r\n{head}\r\n".encode() + data)
        await writer.drain()
        exchange = cls(reader, writer)
        exchange.status = int((await reader.readline()).split()[1])
        while (line := await reader.readline()).strip():
            key, _, value = line.decode().partition(":")
            exchange.headers[key.strip().lower()] = value.strip()
        return exchange

    async def event(self) -> dict | str | None:
        """The next SSE `data:` payload (parsed JSON, or "[DONE]"); None at the end."""
        while line := await self.reader.readline():
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                return payload.decode() if payload == b"[DONE]" else json.loads(payload)
        return None

    async def json(self) -> dict:
        return json.loads(await self.reader.read())

    def hang_up(self) -> None:
        self.writer.close()


def completion(max_tokens: int, stream: bool = True, **extra) -> dict:
    return {"model": "ignored-by-the-fixture", "prompt": "Tell me a long story.", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream, **extra}


def with_model(cluster, body: dict) -> dict:
    return {**body, "model": Path(cluster.config.model).name}


async def pool_stats(cluster) -> scheduler_pb2.PoolStats:
    return await cluster.pool_stats()


def test_an_oversized_body_is_a_413_naming_the_limit(cluster):
    async def go():
        big = with_model(cluster, completion(4, prompt="x" * (BODY_LIMIT + 10)))
        exchange = await Exchange.post(cluster, "/v1/completions", big)
        return exchange.status, await exchange.json()

    status, body = run(go())
    assert status == 413
    assert body["error"]["param"] == "body" and str(BODY_LIMIT) in body["error"]["message"]
    assert body["error"]["code"] == "body_too_large"


def chunked(data: bytes, size: int = 16384) -> bytes:
    """`data` in HTTP/1.1 chunked transfer coding, ended."""
    return b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + size]), data[i:i + size])
                    for i in range(0, len(data), size)) + b"0\r\n\r\n"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_client_still_sending_an_oversized_body_reads_the_413(cluster, framing):
    """The answer comes while the client is still sending (a pause in mid-body): the rest is read
    and dropped, so the client reads a 413 and a clean end, not a connection reset (a socket
    closed with bytes unread resets; before, this client was reset every time)."""
    async def go():
        router = cluster.config.router
        reader, writer = await asyncio.open_connection(router.host, router.http_port)
        data = json.dumps(with_model(cluster, completion(4, prompt="x" * (3 * BODY_LIMIT)))).encode()
        if framing == "chunked":
            head, data = b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n", chunked(data)
        else:
            head = b"POST /v1/completions HTTP/1.0\r\ncontent-length: %d\r\n" % len(data)
        writer.write(head + b"host: test\r\nconnection: close\r\ncontent-type: application/json\r\n\r\n"
                     + data[:2 * BODY_LIMIT])
        await writer.drain()
        await asyncio.sleep(0.3)                 # the server has everything it needs to refuse
        for start in range(2 * BODY_LIMIT, len(data), 8192):     # the rest, as a slow link brings it
            writer.write(data[start:start + 8192])
            await writer.drain()
            await asyncio.sleep(0.01)
        answer = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        return answer

    head, _, body = run(go()).partition(b"\r\n\r\n")
    assert head.split()[1] == b"413"
    error = json.loads(body)["error"]
    assert error["code"] == "body_too_large" and str(BODY_LIMIT) in error["message"]


def test_a_body_declared_far_over_the_limit_is_refused_without_waiting_for_it(cluster):
    """Past 4x the limit the front reads nothing more: the 413 comes while the 10 GB body is
    still unsent (the read timeout is 30 s; this waits 10)."""
    async def go():
        router = cluster.config.router
        reader, writer = await asyncio.open_connection(router.host, router.http_port)
        writer.write(b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
                     b"content-length: 10000000000\r\n\r\n{")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return answer

    head, _, body = run(go()).partition(b"\r\n\r\n")
    assert head.split()[1] == b"413" and json.loads(body)["error"]["code"] == "body_too_large"


def test_a_client_gone_in_mid_body_is_no_error_at_any_endpoint(cluster):
    """A client that hangs up while sending its body: nobody to answer and nothing wrong here, so
    the router logs no error (the endpoints beside generation let Starlette log a traceback)."""
    log = cluster.log_dir / "router.log"
    before = log.stat().st_size

    async def hang_up_in_mid_body(path: str) -> None:
        router = cluster.config.router
        reader, writer = await asyncio.open_connection(router.host, router.http_port)
        writer.write(f"POST {path} HTTP/1.0\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n"
                     f"\r\n".encode() + b'{"model": "x", "prompt": "half of a')
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()

    for path in ("/tokenize", "/detokenize", "/v1/chat/completions", "/v1/completions"):
        run(hang_up_in_mid_body(path))
    async def healthy():
        exchange = await Exchange.post(cluster, "/detokenize", with_model(cluster, {"model": "", "tokens": [1]}))
        return exchange.status
    assert run(healthy()) == 200
    with open(log, "rb") as logged:
        logged.seek(before)
        added = logged.read().decode(errors="replace")
    assert "Traceback" not in added and "ClientDisconnect" not in added, added[-2000:]


def test_a_full_queue_is_a_429_with_retry_after(cluster):
    async def go():
        running = await Exchange.post(cluster, "/v1/completions", with_model(cluster, completion(400)),
                                      {"x-priority": "low"})
        assert running.status == 200 and isinstance(await running.event(), dict)
        waiting = asyncio.create_task(Exchange.post(cluster, "/v1/completions",
                                                    with_model(cluster, completion(4)), {"x-priority": "low"}))
        for _ in range(100):                     # until the second one waits in Low's queue
            if (await pool_stats(cluster)).classes[2].waiting == 1:
                break
            await asyncio.sleep(0.05)
        refused = await Exchange.post(cluster, "/v1/completions", with_model(cluster, completion(4)),
                                      {"x-priority": "low"})
        body = await refused.json()
        running.hang_up()
        (await waiting).hang_up()
        return refused, body

    refused, body = run(go())
    assert refused.status == 429
    assert refused.headers["retry-after"] == "2" and refused.headers["retry-after-ms"] == "1500"
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
    assert "low queue of pool cpu is full" in body["error"]["message"]


def test_a_client_that_disconnects_mid_stream_frees_its_kv_blocks(cluster):
    async def go():
        exchange = await Exchange.post(cluster, "/v1/chat/completions", with_model(cluster, {
            "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 500,
            "ignore_eos": True, "stream": True}))
        first = await exchange.event()
        held = (await pool_stats(cluster)).kv_blocks_used
        exchange.hang_up()
        for _ in range(100):
            stats = await pool_stats(cluster)
            if stats.kv_blocks_used == 0 and not any(c.running for c in stats.classes):
                return first, held, stats
            await asyncio.sleep(0.05)
        return first, held, stats

    first, held, stats = run(go())
    assert first["choices"][0]["delta"]["role"] == "assistant" and held > 0
    assert stats.kv_blocks_used == 0 and not any(c.running for c in stats.classes)


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_event(cluster):
    async def go():
        exchange = await Exchange.post(cluster, "/v1/completions", with_model(cluster, completion(500)))
        assert isinstance(await exchange.event(), dict)
        cluster.processes["cpu/worker-0"].send_signal(signal.SIGKILL)
        events = []
        while (event := await asyncio.wait_for(exchange.event(), 10)) is not None:
            events.append(event)
        await asyncio.sleep(0.5)      # the scheduler sees the link down
        after = await Exchange.post(cluster, "/v1/completions", with_model(cluster, completion(4, stream=False)))
        return events, after, await after.json()

    events, after, body = run(go())
    assert events and events[-1]["error"]["type"] == "service_unavailable"
    assert "has no worker left" in events[-1]["error"]["message"]
    assert "[DONE]" not in events
    # No worker left in the pool: refused at once, with when to retry.
    assert after.status == 503 and int(after.headers["retry-after-ms"]) > 0
    assert "no worker of pool cpu" in body["error"]["message"]
