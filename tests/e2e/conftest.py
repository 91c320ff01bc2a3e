"""A real local cluster (router, scheduler, CPU worker as separate processes on loopback)."""
from __future__ import annotations

import asyncio

import pytest

from services.cluster import LocalCluster
from services.common.config import ClusterConfig, RouterConfig, SchedulerConfig, WorkerConfig


def cluster_config(**scheduler) -> ClusterConfig:
    return ClusterConfig(router=RouterConfig(port=0), scheduler=SchedulerConfig(port=0, **scheduler),
                         workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=256)])


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(cluster_config(), quiet=True) as running:
        yield running


def run(coro):
    return asyncio.run(coro)
