"""A real local cluster (router, scheduler, CPU worker as separate processes on loopback)."""
from __future__ import annotations

import asyncio

import pytest

from services.cluster import LocalCluster
from services.common.config import ClusterConfig, RouterConfig, SchedulerConfig, WorkerConfig, single_pool


def cluster_config(kv_cache_mb: int = 256, **scheduler) -> ClusterConfig:
    return single_pool(router=RouterConfig(port=0, http_port=0), scheduler=SchedulerConfig(port=0, **scheduler),
                       workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=kv_cache_mb)])


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(cluster_config(), quiet=True) as running:
        yield running


def run(coro):
    return asyncio.run(coro)
