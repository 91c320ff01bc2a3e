"""A tenant's flood does not lock another out of a class's queue (services/scheduler/admission.py
check_queue, with tenant fairness, the default): on a real cluster with max_queue 4 and one
running slot, tenant a fills the medium queue and its next request is refused naming its own
count, while tenant b's request is still taken, and served first once the slot frees (fair order),
ahead of a's queued four. Auth off: tenants by x-tenant. HTTP front."""
from __future__ import annotations

import asyncio
import json

import pytest

from services.common.priority import MEDIUM
from services.local.cluster import LocalCluster
from tests.e2e.conftest import bench_model, cluster_config, run
from tests.e2e.test_http_faults import Exchange

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(cluster_config(model=bench_model(), dtype="fp32", max_running=1, max_queue=4),
                      quiet=True) as running:
        yield running


def body(max_tokens: int) -> dict:
    return {"model": bench_model().rsplit("/", 1)[-1], "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}


async def medium_waiting(cluster) -> int:
    stats = await cluster.pool_stats()
    return next(c.waiting for c in stats.classes if c.priority == MEDIUM)


async def first_token_order(cluster):
    started: list[str] = []

    async def stream(tenant: str, name: str, max_tokens: int):
        exchange = await Exchange.post(cluster, "/v1/completions", body(max_tokens), {"x-tenant": tenant})
        if exchange.status != 200:
            return exchange.status, json.loads((await exchange.reader.read()).decode())
        started.append(name)
        while await exchange.event() is not None:
            pass
        return 200, None

    flood = [asyncio.create_task(stream("a", f"a{i}", 300 if i == 0 else 20)) for i in range(5)]
    while await medium_waiting(cluster) < 4:            # a0 runs, a1-a4 wait: the queue is full
        await asyncio.sleep(0.05)
    refused = await stream("a", "a5", 20)               # a holds all 4 places: its share
    b = asyncio.create_task(stream("b", "b0", 20))      # b holds none: still taken
    answers = await asyncio.gather(*flood, b)
    return refused, answers, started


def test_a_full_queue_refuses_the_flooding_tenant_and_takes_another(cluster):
    refused, answers, started = run(first_token_order(cluster))
    status, error = refused
    assert status == 429 and error["error"]["code"] == "queue_full"
    assert "4 of your requests wait in it" in error["error"]["message"]
    assert all(answer == (200, None) for answer in answers)
    assert started[0] == "a0" and started[1] == "b0", started     # b ahead of a's queued four
