"""Autoscaling on a real cluster (`qos-serve up --autoscale`'s launcher): a High backlog over the
threshold makes the pool want a second worker, the launcher starts one that joins at run time and
takes work; once the pool is idle it drains the extra worker away, and no request is lost."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.common.config import AutoscaleConfig
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.proto.qos.v1 import router_pb2_grpc, scheduler_pb2
from services.local.cluster import LocalCluster
from services.tools.client import chat_request, sampling_params
from tests.e2e.conftest import bench_model, cluster_config, run

pytestmark = pytest.mark.slow

# High requests kept in flight (4 run, the rest queue: over the backlog threshold of 3) until the
# extra worker has taken work. A fixed burst raced the new worker's start: on a fast host the first
# worker had admitted the last of it by the time the second joined, and the second took nothing.
IN_FLIGHT = 12
GIVE_UP_S = 60.0             # so that an autoscaler that never helps fails instead of running on


async def one(stub, i) -> str:
    request = chat_request(f"Story {i}:", sampling_params(max_tokens=48, ignore_eos=True))
    try:
        async for chunk in stub.Generate(request, metadata=[("x-priority", "high")]):
            if chunk.finish_reason:
                return "completed"
    except grpc.aio.AioRpcError as error:
        return f"failed: {error.code().name}"
    return "lost"


async def burst(cluster, enough: asyncio.Event) -> list[str]:
    """Keep IN_FLIGHT requests going until `enough` is set; then every answer."""
    async with grpc.aio.insecure_channel(cluster.router_address, options=CHANNEL_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        calls: list[asyncio.Task] = []
        give_up = time.monotonic() + GIVE_UP_S
        while not enough.is_set() and time.monotonic() < give_up:
            if sum(not c.done() for c in calls) < IN_FLIGHT:
                calls.append(asyncio.create_task(one(stub, len(calls))))
            else:
                await asyncio.sleep(0.05)
        return await asyncio.gather(*calls)


async def pool_stats(cluster) -> scheduler_pb2.PoolStats:
    return await cluster.pool_stats()


def test_a_high_backlog_scales_out_then_idle_scales_back_in_losing_nothing():
    config = cluster_config(max_running=4, model=bench_model())
    config.pools[0].autoscale = AutoscaleConfig(
        max_workers=2, scale_out_high_backlog=3, scale_out_cooldown_s=2.0, scale_in_below=0.25,
        scale_in_after_s=3.0, scale_in_cooldown_s=3.0)
    lines = []
    with LocalCluster(config, quiet=True, autoscale=True) as cluster:
        cluster.autoscaler.say = lines.append

        def extra_members(seen):
            return [m for s in seen for m in s.members if m.address != config.pools[0].workers[0].address]

        async def watched_burst():
            seen, enough = [], asyncio.Event()
            task = asyncio.create_task(burst(cluster, enough))
            while not task.done():
                seen.append(await pool_stats(cluster))
                if any(m.admitted for m in extra_members(seen)):
                    enough.set()
                await asyncio.sleep(0.3)
            return await task, seen

        outcomes, seen = run(watched_burst())
        assert outcomes.count("completed") == len(outcomes), outcomes
        assert max(s.desired_workers for s in seen) == 2 and max(s.workers for s in seen) == 2
        assert any(s.scale_reason.startswith("High backlog") for s in seen)
        assert max(m.admitted for m in extra_members(seen)) > 0          # the new worker took work
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            stats = run(pool_stats(cluster))
            if stats.workers == 1 and stats.desired_workers == 1 and not cluster.autoscaler.extras["cpu"]:
                break
            time.sleep(0.5)
        assert (stats.workers, stats.desired_workers) == (1, 1) and stats.scale_reason.startswith("load")
        assert not cluster.autoscaler.extras["cpu"]          # the extra worker drained and left
    assert lines[0].startswith("autoscale: pool cpu: 1 -> 2 workers (High backlog")
    assert lines[-1].startswith("autoscale: pool cpu: 2 -> 1 workers (load")
