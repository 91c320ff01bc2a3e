"""Two real pools (separate schedulers and workers): a Low burst overflows to the cheaper pool once
the primary queues; High stays on the primary; pools and costs show in responses and Stats."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.config import ClusterConfig, PoolConfig, RouterConfig, SchedulerConfig, WorkerConfig
from services.common.proto.qos.v1 import router_pb2, router_pb2_grpc
from services.local.cluster import LocalCluster
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import bench_model, run
from tests.e2e.test_observability import scrape

pytestmark = pytest.mark.slow


def two_pools() -> ClusterConfig:
    def pool(name, cost, primary, max_running):
        return PoolConfig(name=name, device="cpu", cost_per_token=cost, primary=primary,
                          scheduler=SchedulerConfig(port=0, max_running=max_running, max_step_tokens=64),
                          workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=64)])
    # The primary runs 2 sequences at a time, so a burst queues there quickly.
    return ClusterConfig(router=RouterConfig(port=0, http_port=0), model=bench_model(),
                         pools=[pool("big", 0.2, True, 2), pool("small", 0.05, False, 4)])


def test_low_burst_overflows_to_the_cheaper_pool_and_high_stays_on_the_primary():
    with LocalCluster(two_pools(), quiet=True) as cluster:
        async def go():
            async with RouterClient(cluster.router_address) as client:
                params = sampling_params(max_tokens=16, temperature=0.0, ignore_eos=True)
                lows = [client.generate(chat_request(f"Tell me about the number {i}.", params),
                                        priority="low", tenant="batch") for i in range(20)]
                low_answers = await asyncio.gather(*lows[:14])
                highs = await asyncio.gather(*[client.generate(chat_request(f"Hi {i}!", params),
                                                                priority="high", tenant="chat")
                                               for i in range(3)])
                low_answers += await asyncio.gather(*lows[14:])
            async with grpc.aio.insecure_channel(cluster.router_address) as channel:
                stats = await router_pb2_grpc.RouterStub(channel).Stats(router_pb2.StatsRequest())
            return low_answers, highs, stats

        lows, highs, stats = run(go())
        low_pools = [a.pool for a in lows]
        assert "small" in low_pools and "big" in low_pools, low_pools
        assert all(a.pool == "big" for a in highs)
        assert all(a.finish_reason == "length" for a in lows + highs)
        cost = {"big": 0.2, "small": 0.05}
        # tokens x the pool's cost per token x the class's billing multiplier (High 3, Low 1), the
        # prompt tokens the prefix cache served (the chat template's opening) at half price
        for answer, multiplier in [(a, 1.0) for a in lows] + [(a, 3.0) for a in highs]:
            assert answer.cost_units == pytest.approx(
                (answer.total_tokens - 0.5 * answer.cached_tokens) * cost[answer.pool] * multiplier)
        assert any(a.cached_tokens for a in lows)

        by_pool = {g.name: g for g in stats.by_pool}
        assert by_pool["small"].requests == low_pools.count("small")
        assert by_pool["big"].requests == low_pools.count("big") + 3
        assert by_pool["small"].cost_units == pytest.approx(
            sum(a.cost_units for a in lows if a.pool == "small"))
        by_tenant = {g.name: g for g in stats.by_tenant}
        assert by_tenant["batch"].requests == 20 and by_tenant["chat"].requests == 3
        assert {p.pool for p in stats.pools} == {"big", "small"}


def test_slo_cost_routing_sends_tolerant_work_to_the_cheap_pool_and_measures_its_predictions():
    config = two_pools()
    config.router.routing = "slo-cost"
    config.router.metrics_port = 0
    with LocalCluster(config, quiet=True) as cluster:
        async def go():
            async with RouterClient(cluster.router_address) as client:
                params = sampling_params(max_tokens=8, temperature=0.0, ignore_eos=True)
                answers = []
                for wave in range(3):     # between waves, the pools' stats reach the router
                    answers += await asyncio.gather(*[
                        client.generate(chat_request(f"Tell me about the number {wave}{i}.", params),
                                        priority="low", slo_ms=60_000) for i in range(4)])
                    await asyncio.sleep(0.6)
                highs = await asyncio.gather(*[client.generate(chat_request(f"Hi {i}!", params),
                                                                priority="high") for i in range(2)])
            async with grpc.aio.insecure_channel(cluster.router_address) as channel:
                stats = await router_pb2_grpc.RouterStub(channel).Stats(router_pb2.StatsRequest())
            return answers, highs, stats

        lows, highs, stats = run(go())
        # A minute's SLO: the cheap pool meets it, so every Low request goes there (the rules of
        # "cost" mode would have kept them on the primary, whose queue stays under the threshold).
        assert [a.pool for a in lows] == ["small"] * 12
        assert all(a.pool == "big" for a in highs)          # High keeps its strict rule
        small = next(p for p in stats.pools if p.pool == "small")
        assert small.step_seconds > 0 and small.step_tokens > 0 and small.max_step_tokens == 64
        metrics = scrape(config.router.host, config.router.metrics_port)
        # Requests routed after the pools reported their first steps carry a prediction whose
        # error is measured: at least the last wave of Low and the High ones.
        counted = sum(v for (name, _), v in metrics.items() if name == "qos_route_prediction_error_ms_count")
        assert counted >= 6, {k: v for k, v in metrics.items() if "prediction" in k[0]}
        assert any(name == "qos_route_prediction_margin" for name, _ in metrics)
