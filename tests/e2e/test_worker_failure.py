"""The only worker killed mid-stream and not back: after the pool's orphan grace every affected
client gets UNAVAILABLE saying the pool has no worker left, never a hang; the cluster serves again
once the worker is back. (A worker back within the grace, or a second worker, finishes the
streams instead: tests/e2e/test_failover.py.)"""
from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from services.local.cluster import LocalCluster
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import bench_model, cluster_config, run

pytestmark = pytest.mark.slow

GRACE_S = 1.0


def test_killed_worker_fails_streams_fast_and_recovery_follows():
    with LocalCluster(cluster_config(orphan_grace_s=GRACE_S, model=bench_model()), quiet=True) as cluster:
        async def stream_until_killed(client, prompt):
            call = client.stream(chat_request(prompt, sampling_params(max_tokens=500, ignore_eos=True)),
                                 priority="medium")
            tokens = 0
            try:
                async for chunk in call:
                    tokens += len(chunk.token_ids)
                    if tokens >= 3:       # several tokens a chunk after the first (Medium: 4)
                        started.set()
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details(), time.monotonic()
            return grpc.StatusCode.OK, "", time.monotonic()

        async def go():
            async with RouterClient(cluster.router_address) as client:
                streams = [asyncio.create_task(stream_until_killed(client, f"Story number {i}"))
                           for i in range(6)]
                await asyncio.wait_for(started.wait(), 60)
                await asyncio.sleep(0.3)
                cluster.processes["cpu/worker-0"].send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                return await asyncio.wait_for(asyncio.gather(*streams), 15), killed_at

        started = asyncio.Event()
        outcomes, killed_at = run(go())
        for code, details, ended in outcomes:
            assert code == grpc.StatusCode.UNAVAILABLE, details
            assert "pool cpu has no worker left" in details and "no other pool serves" in details
            assert GRACE_S <= ended - killed_at < GRACE_S + 2.0

        cluster.processes["cpu/worker-0"].wait()
        cluster.start_worker("cpu", 0)

        async def serve_again():
            for _ in range(600):
                if (await cluster.pool_stats()).workers == 1:
                    break
                await asyncio.sleep(0.1)
            async with RouterClient(cluster.router_address) as client:
                return await client.generate(chat_request("Hello!", sampling_params(max_tokens=8)),
                                             priority="high")

        answer = run(serve_again())
        assert answer.finish_reason in ("stop", "length") and answer.token_ids
