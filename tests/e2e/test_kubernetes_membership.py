"""The Kubernetes cpu overlay's cluster config, run for real on loopback: the scheduler finds its
workers by resolving the headless Service name `qos-workers-cpu`, here answered by a test
resolver (tests/e2e/dns_stub, loaded into the service processes) whose addresses the test changes
as Kubernetes would when pods come and go. Workers are separate processes on 127.0.0.2, .3, ...
and one port, as pods are on one port and different IPs. A worker added to the "Service" joins and
serves; one removed (its DNS record gone and SIGTERM, as on a pod deletion) loses no request.

Only the addresses change: hosts the services dial through gRPC (router -> scheduler) become
127.0.0.1 and every port a free one (tests bind free loopback ports); the rest is the overlay's."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import grpc
import pytest

from services.common.config_file import parse_config
from services.common.grpc_server import CHANNEL_OPTIONS, wait_healthy
from services.common.ports import free_port
from services.common.proto.qos.v1 import router_pb2_grpc, scheduler_pb2
from services.local.cluster import LocalCluster
from services.tools.client import chat_request, sampling_params
from tests.e2e.conftest import bench_model, run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
OVERLAY_CONFIG = ROOT / "deploy" / "kubernetes" / "overlays" / "cpu" / "cluster.toml"
STUB = Path(__file__).resolve().parent / "dns_stub"
ADMIN = "k8s-test-admin"


@pytest.fixture
def overlay(tmp_path, monkeypatch):
    config = parse_config(tomllib.loads(OVERLAY_CONFIG.read_text()))
    (pool,) = config.pools
    service, worker_port = pool.scheduler.workers_dns.rsplit(":", 1)[0], free_port()
    assert service == "qos-workers-cpu" and pool.scheduler.workers_from == "dns"
    config.router.host, config.router.port, config.router.http_port = "127.0.0.1", free_port(), -1
    config.router.metrics_port = pool.scheduler.metrics_port = None
    pool.scheduler.host, pool.scheduler.port = "127.0.0.1", free_port()
    pool.scheduler.workers_dns = f"{service}:{worker_port}"
    pool.scheduler.workers_dns_interval_s = 1.0          # the overlay's 5 s, shortened for the test
    # Every prompt here opens with the chat template's tokens, cached on the first worker: at
    # margin 0 any difference in load wins, so the worker that joins takes streams at once.
    pool.scheduler.cache_affinity_margin = 0.0
    pool.workers[0].host, pool.workers[0].port, pool.workers[0].metrics_port = "127.0.0.1", worker_port, None
    config.store.url, config.auth.admin_key = f"sqlite:///{tmp_path}/store.db", ADMIN
    config.model = bench_model()                        # membership is under test, not the text
    dns = tmp_path / "dns.json"
    monkeypatch.setenv("QOS_TEST_DNS_FILE", str(dns))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STUB), os.environ.get("PYTHONPATH", "")]))
    cluster = LocalCluster(config, quiet=True)
    processes: dict[str, subprocess.Popen] = {}

    def publish(*ips: str) -> None:                     # the headless Service's ready endpoints
        dns.write_text(json.dumps({service: list(ips)}))

    def start_worker(ip: str) -> None:
        processes[ip] = cluster.launch(f"worker-{ip}", "worker", "--pool", "cpu", "--listen", ip,
                                       "--port", str(worker_port))

    cluster.publish, cluster.start_worker, cluster.worker_processes = publish, start_worker, processes
    cluster.worker_port = worker_port
    try:
        yield cluster
    finally:
        for process in [*processes.values(), *cluster.processes.values()]:
            if process.poll() is None:
                process.kill()
                process.wait()
        cluster.processes.clear()
        cluster.close()


async def pool_stats(cluster) -> scheduler_pb2.PoolStats:
    return await cluster.pool_stats()


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


async def streams(cluster, count: int, max_tokens: int, while_streaming=None) -> list[tuple[str, int]]:
    """`count` greedy High streams at once; `while_streaming()` runs once each has a token."""
    started = asyncio.Event()
    first = 0

    async def one(stub, i):
        nonlocal first
        tokens = 0
        try:
            request = chat_request(f"Story {i}:", sampling_params(max_tokens=max_tokens, ignore_eos=True))
            async for chunk in stub.Generate(request, metadata=[("x-priority", "high"),
                                                                ("authorization", f"Bearer {ADMIN}")]):
                if chunk.token_ids and tokens == 0:
                    first += 1
                    if first == count:
                        started.set()
                tokens += len(chunk.token_ids)
                if chunk.finish_reason:
                    return "completed", tokens
        except grpc.aio.AioRpcError as error:
            return f"failed: {error.code().name} {error.details()}", tokens
        return "lost", tokens

    async with grpc.aio.insecure_channel(cluster.router_address, options=CHANNEL_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        tasks = [asyncio.create_task(one(stub, i)) for i in range(count)]
        if while_streaming is not None:
            await asyncio.wait_for(started.wait(), 120)
            await asyncio.to_thread(while_streaming)
        return await asyncio.gather(*tasks)


def test_workers_join_and_leave_through_the_headless_service(overlay):
    cluster = overlay
    cluster.publish("127.0.0.2")
    cluster.start_worker("127.0.0.2")
    cluster._spawn("cpu/scheduler", "scheduler", "--pool", "cpu")
    cluster._spawn("router", "router")
    for address in (f"127.0.0.2:{cluster.worker_port}", cluster.scheduler_address, cluster.router_address):
        assert run(wait_healthy(address, timeout=120)), address
    wait_until(lambda: run(pool_stats(cluster)).workers == 1, 60, "the first worker, found through DNS")
    assert all(o == ("completed", 8) for o in run(streams(cluster, 4, 8)))

    # A pod is added: ready first, then in the Service's DNS answer.
    cluster.start_worker("127.0.0.3")
    assert run(wait_healthy(f"127.0.0.3:{cluster.worker_port}", timeout=120))
    cluster.publish("127.0.0.2", "127.0.0.3")
    wait_until(lambda: run(pool_stats(cluster)).workers == 2, 30, "the added worker to join")
    assert all(o == ("completed", 24) for o in run(streams(cluster, 12, 24)))
    admitted = {m.address: m.admitted for m in run(pool_stats(cluster)).members}
    assert admitted[f"127.0.0.3:{cluster.worker_port}"] > 0, admitted      # the new pod serves

    # A pod is deleted while streams run on both: its endpoint leaves DNS and it gets SIGTERM.
    def delete_pod():
        cluster.publish("127.0.0.3")
        cluster.worker_processes["127.0.0.2"].send_signal(signal.SIGTERM)

    outcomes = run(streams(cluster, 12, 48, while_streaming=delete_pod))
    assert outcomes == [("completed", 48)] * 12, outcomes                 # nothing lost
    assert cluster.worker_processes["127.0.0.2"].wait(timeout=60) == 0     # it drained and exited
    # Its link disconnects (workers == 1) before the next DNS answer takes it out of the members.
    remaining = [f"127.0.0.3:{cluster.worker_port}"]
    stats = wait_until(lambda: (s := run(pool_stats(cluster))).workers == 1
                       and [m.address for m in s.members] == remaining and s, 30, "the removed worker to leave")
    assert [m.address for m in stats.members] == remaining
