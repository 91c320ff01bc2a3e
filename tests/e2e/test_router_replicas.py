"""Two router replicas over the same pool, sharing tenant limits through PostgreSQL ([auth]
replicas = 2 in a local cluster): one replica taking all of a tenant's traffic gets the tenant's
whole limit, the two together never admit more than it, and a router SIGKILLed mid-load loses no
client that retries on the other (same texts as without the fault, every completion billed once)."""
from __future__ import annotations

import asyncio
import http.client
import json
import signal
import time
from pathlib import Path

import grpc
import pytest

from services.local.cluster import LocalCluster
from services.store.store import Store, Tenant
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import bench_model, cluster_config, run
from tests.postgres import database_url

pytestmark = pytest.mark.slow

RPM = 8
MODEL = [""]       # the served model's name, once the cluster is up


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with database_url("postgresql", tmp_path_factory.mktemp("replicas")) as url:
        store = Store(url)
        store.add_tenant(Tenant("shared", rpm=RPM))
        store.add_tenant(Tenant("streams", max_concurrent=2))
        store.close()
        # fp32: a killed router's retried streams are compared with calm ones, batched otherwise;
        # equal texts hold where the numbers do not depend on the batch.
        config = cluster_config(model=bench_model(), dtype="fp32")
        config.store.url, config.auth.replicas, config.billing.flush_seconds = url, 2, 0.2
        with LocalCluster(config, quiet=True) as running:
            running.store_url = url
            MODEL[0] = Path(running.config.model).name
            yield running


def post(address: str, tenant: str, max_tokens: int = 1, **extra) -> tuple[int, dict, dict]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        body = {"model": MODEL[0], "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, **extra}
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"content-type": "application/json", "x-tenant": tenant})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read())
    finally:
        conn.close()


def test_two_replicas_start_and_both_serve(cluster):
    assert len(cluster.router_addresses) == 2 and len(cluster.router_http_addresses) == 2
    for address in cluster.router_http_addresses:
        assert post(address, "someone")[0] == 200


def test_one_replica_gets_the_whole_limit_and_the_two_never_admit_more(cluster):
    first, second = cluster.router_http_addresses
    admitted, refusals, deadline = 0, [], time.monotonic() + 30
    while admitted < RPM and time.monotonic() < deadline:
        status, headers, body = post(first, "shared")
        if status == 200:
            admitted += 1
        else:                        # over this replica's share until the shares move: wait as told
            assert status == 429 and body["error"]["code"] == "rate_limit_requests", body
            refusals.append(body["error"]["message"])
            time.sleep(min(2.0, int(headers["retry-after"])))
    assert admitted == RPM, refusals
    # The tenant is at its limit on both replicas now.
    for address in (first, second):
        status, headers, body = post(address, "shared")
        assert status == 429 and body["error"]["code"] == "rate_limit_requests"
        assert f"over its {RPM} requests per minute" in body["error"]["message"]
        assert 1 <= int(headers["retry-after"]) <= 60
    # Hammering both for a few more seconds admits nothing more within the minute.
    extra = 0
    for _ in range(6):
        extra += sum(post(address, "shared")[0] == 200 for address in (first, second))
        time.sleep(0.5)
    assert extra == 0


def test_concurrent_streams_are_shared_too(cluster):
    first, second = cluster.router_addresses
    long = chat_request("Count slowly.", sampling_params(max_tokens=3000, temperature=0.0, ignore_eos=True))

    async def open_stream(client: RouterClient):
        """A stream whose first chunk has arrived (it holds one of the tenant's two), or its refusal."""
        call = client.stream(long, priority="low", tenant="streams")
        try:
            await call.read()
            return call
        except grpc.aio.AioRpcError as refused:
            return refused

    async def go():
        async with RouterClient(first) as a, RouterClient(second) as b:
            held, refusals = [], []
            deadline = time.monotonic() + 20
            while len(held) < 2 and time.monotonic() < deadline:     # the second, once the shares allow it
                opened = await open_stream(a)
                if isinstance(opened, grpc.aio.AioRpcError):
                    refusals.append(opened)
                    await asyncio.sleep(0.6)
                else:
                    held.append(opened)
            await asyncio.sleep(1.5)       # shares exchanged with both streams open on the first replica
            on_second = await open_stream(b)
            for call in held + ([] if isinstance(on_second, grpc.aio.AioRpcError) else [on_second]):
                call.cancel()
            return held, refusals, on_second

    held, refusals, on_second = run(go())
    assert len(held) == 2, [r.details() for r in refusals]
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refusals)
    assert isinstance(on_second, grpc.aio.AioRpcError), "the second replica let a third stream open"
    assert on_second.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent 2" in on_second.details()


def test_a_router_killed_mid_load_loses_no_client_that_retries_on_the_other(cluster):
    prompts = [f"Write a line about the number {i}." for i in range(16)]
    params = dict(max_tokens=64, temperature=0.0, ignore_eos=True)
    streaming = asyncio.Event()

    async def answer(client: RouterClient, prompt: str) -> tuple[str, str]:
        text, last = [], None
        async for chunk in client.stream(chat_request(prompt, sampling_params(**params)), priority="medium",
                                         tenant="retrying"):
            text.append(chunk.text)
            last = chunk
            if len(text) == 4:
                streaming.set()
        assert last is not None and last.finish_reason
        return "".join(text), last.request_id

    async def with_retry(i: int, clients: list[RouterClient], retried: list[int]) -> tuple[str, str]:
        await asyncio.sleep(0.05 * i)
        try:
            return await answer(clients[0], prompts[i])
        except grpc.aio.AioRpcError as cut:
            assert cut.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.INTERNAL), cut     # the connection went away with it
            retried.append(i)
            return await answer(clients[1], prompts[i])

    async def go():
        async with RouterClient(cluster.router_addresses[1]) as survivor:
            calm = await asyncio.gather(*(answer(survivor, p) for p in prompts))     # texts without a fault
            streaming.clear()
            async with RouterClient(cluster.router_addresses[0]) as doomed:
                retried: list[int] = []
                tasks = [asyncio.create_task(with_retry(i, [doomed, survivor], retried)) for i in range(len(prompts))]
                await streaming.wait()     # streams under way on the first router
                cluster.processes["router"].send_signal(signal.SIGKILL)
                return calm, await asyncio.gather(*tasks), retried

    calm, answers, retried = run(go())
    assert retried, "the kill should have cut some streams"
    assert [text for text, _ in answers] == [text for text, _ in calm]
    time.sleep(1.0)                        # the survivor's last ledger batch
    store = Store(cluster.store_url)
    rows = {r["request_id"]: r for r in store.ledger_rows(tenant="retrying")}
    store.close()
    for _, request_id in answers:          # every completion a client saw is billed, once
        assert rows[request_id]["outcome"] == "completed"
    assert len({request_id for _, request_id in answers}) == len(prompts)


def test_the_replicas_share_through_the_store(cluster):
    store = Store(cluster.store_url)
    try:
        with store.engine.connect() as db:
            replicas = {row[0] for row in db.exec_driver_sql("SELECT replica FROM limit_shares")}
    finally:
        store.close()
    # the survivor's rows, and the killed one's, which linger until forgotten (FORGET_S)
    assert len(replicas) == 2
