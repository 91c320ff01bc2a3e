"""SIGTERM to a service with streams in flight: it drains. Health says NOT_SERVING at once, a new
request is refused with UNAVAILABLE naming the drain (and when to retry), every stream in flight
finishes with its full text, and the process exits 0 within its drain time. What a rolling update
on Kubernetes or `docker compose stop` does to us."""
from __future__ import annotations

import asyncio
import http.client
import json
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.cluster_auth import ClusterTrust
from services.common.proto.qos.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.tokenizer import TextTokenizer
from services.local.cluster import LocalCluster
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import bench_model, cluster_config, run

pytestmark = pytest.mark.slow

STREAMS = 8
TOKENS = 160         # a few seconds of streaming on the bench model: the drain is probed meanwhile
DRAIN_SECONDS = 60.0


def drain_cluster() -> LocalCluster:
    # The worker test restarts the pool's only worker: requests queued meanwhile must wait for it.
    config = cluster_config(orphan_grace_s=DRAIN_SECONDS, model=bench_model())
    for section in (config.router, config.pools[0].scheduler, *config.pools[0].workers):
        section.drain_seconds = DRAIN_SECONDS
    return LocalCluster(config, quiet=True)


def long_request(i: int):
    return chat_request(f"Tell story number {i} about a lighthouse.",
                        sampling_params(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))


async def health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2)
        return reply.status


async def refusal(client: RouterClient, priority: str = "high") -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.generate(chat_request("Hello!", sampling_params(max_tokens=4)), priority=priority)
    return caught.value


async def streams_in_flight(client: RouterClient):
    """Start the streams and return once every one has streamed its first token."""
    started = [asyncio.Event() for _ in range(STREAMS)]

    async def one(i: int):
        answer = await client.generate(long_request(i), priority="medium",
                                       on_text=lambda _text: started[i].set())
        started[i].set()
        return answer

    tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    return tasks


def assert_complete(answers, tokenizer: TextTokenizer) -> None:
    for answer in answers:
        assert answer.finish_reason == "length" and len(answer.token_ids) == TOKENS
        assert answer.text == tokenizer.decode(answer.token_ids)   # nothing held back or cut


def retry_after_ms(error: grpc.aio.AioRpcError) -> int:
    return int(dict(error.trailing_metadata() or ())["retry-after-ms"])


def sigterm_mid_stream(cluster: LocalCluster, name: str, probe, after_exit=None):
    """Streams in flight, SIGTERM to `name`, then `probe(client)` while it drains, and once the
    process has exited `after_exit(client, probed)`. Returns the answers, what the probe (and
    after_exit) returned, the exit code and how long the process took to exit."""
    process = cluster.processes[name]

    async def go():
        async with RouterClient(cluster.router_address) as client:
            tasks = await streams_in_flight(client)
            process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            await asyncio.sleep(0.3)
            probed = await probe(client)
            assert any(not t.done() for t in tasks), "the streams ended before the drain was probed"
            answers = await asyncio.gather(*tasks)
            finished_after = time.monotonic() - sent
            code = await asyncio.get_running_loop().run_in_executor(
                None, lambda: process.wait(timeout=DRAIN_SECONDS + 10))
            exited_after = time.monotonic() - sent
            print(f"\n{name}: SIGTERM with {STREAMS} streams in flight; all finished "
                  f"{finished_after:.1f} s later, the process exited {exited_after:.1f} s after "
                  f"SIGTERM with code {code}")
            if after_exit is not None:
                probed = await after_exit(client, probed)
            return answers, probed, code, exited_after

    return run(go())


def test_scheduler_drains_on_sigterm():
    with drain_cluster() as cluster:
        async def probe(client):
            status = await health(cluster.scheduler_address)
            alive = await health(cluster.scheduler_address, "liveness")     # draining is not dead
            assert alive == health_pb2.HealthCheckResponse.SERVING
            # Straight to the scheduler, and through the router, which relays its refusal.
            async with cluster.trust.channel(cluster.scheduler_address, "scheduler") as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as direct:
                    router = ClusterTrust.load(cluster.config.security, "router")   # Submit is the router's
                    async for _ in stub.Submit(scheduler_pb2.SubmitRequest(request_id="late", prompt="Hi"),
                                               metadata=router.metadata):
                        pass
                stats = await stub.GetPoolStats(scheduler_pb2.PoolStatsRequest(), metadata=cluster.trust.metadata)
            return status, direct.value, await refusal(client), stats

        answers, (status, direct, routed, stats), code, exited_after = \
            sigterm_mid_stream(cluster, "cpu/scheduler", probe)
        assert_complete(answers, TextTokenizer.from_model_dir(cluster.config.model))

    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    for error in (direct, routed):
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "scheduler of pool cpu is draining" in error.details()
        assert retry_after_ms(error) > 0
    assert stats.draining
    assert code == 0 and exited_after < DRAIN_SECONDS


def http_probe(cluster) -> tuple[int, int, dict, dict]:
    """The HTTP front while the router drains: /health, and a new completion request."""
    router = cluster.config.router
    conn = http.client.HTTPConnection(router.host, router.http_port, timeout=10)
    try:
        conn.request("GET", "/health")
        health_status = conn.getresponse()
        health_status.read()
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "m", "prompt": "Hi"}),
                     headers={"content-type": "application/json"})
        refused = conn.getresponse()
        return health_status.status, refused.status, dict(refused.getheaders()), json.loads(refused.read())
    finally:
        conn.close()


def test_router_drains_on_sigterm():
    with drain_cluster() as cluster:
        async def probe(client):
            http_answers = await asyncio.get_running_loop().run_in_executor(None, http_probe, cluster)
            return await health(cluster.router_address), await refusal(client), http_answers

        answers, (status, refused, http_answers), code, exited_after = \
            sigterm_mid_stream(cluster, "router", probe)
        assert_complete(answers, TextTokenizer.from_model_dir(cluster.config.model))

    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "router is draining" in refused.details() and retry_after_ms(refused) > 0
    http_health, http_status, http_headers, http_body = http_answers
    assert http_health == 503 and http_status == 503 and http_headers["retry-after"] == "1"
    assert http_body["error"]["code"] == "draining"
    assert code == 0 and exited_after < DRAIN_SECONDS


def test_worker_drains_on_sigterm_and_its_replacement_serves_what_queued_meanwhile():
    with drain_cluster() as cluster:
        async def probe(client):
            stats = await cluster.pool_stats()
            # The only worker takes no new sequence: a new request waits in the queue ...
            late = asyncio.create_task(client.generate(
                chat_request("Hello!", sampling_params(max_tokens=4)), priority="high"))
            return await health(cluster.config.pools[0].workers[0].address), stats, late

        async def after_exit(client, probed):
            status, stats, late = probed
            assert not late.done()
            cluster.start_worker("cpu", 0)      # ... until a replacement joins
            return status, stats, await asyncio.wait_for(late, 120)

        answers, (status, stats, late), code, exited_after = \
            sigterm_mid_stream(cluster, "cpu/worker-0", probe, after_exit)
        assert_complete(answers, TextTokenizer.from_model_dir(cluster.config.model))

    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert stats.workers_draining == 1 and not stats.draining
    assert code == 0 and exited_after < DRAIN_SECONDS
    assert late.finish_reason in ("stop", "length") and late.token_ids
