"""A real local cluster (router, scheduler, CPU worker as separate processes on loopback).

Clusters serve the embedded SmolLM2-135M unless a test only needs load, not text worth reading:
those pass model=bench_model(), the QoS benchmark's 4-layer random-weight Llama with the same
tokenizer and architecture (services/engine/bench_model.py), whose steps are ~5x cheaper on one
thread. That keeps `make test` within its 15 minutes on 2 cores."""
from __future__ import annotations

import asyncio
import functools

import pytest

from services.common.config import ClusterConfig, RouterConfig, SchedulerConfig, WorkerConfig, single_pool
from services.local.cluster import LocalCluster


@functools.cache
def bench_model() -> str:
    from services.engine.bench_model import bench_model_dir  # built once from the default model, cached
    return str(bench_model_dir())


def cluster_config(kv_cache_mb: int = 256, model: str = "default", **scheduler) -> ClusterConfig:
    return single_pool(router=RouterConfig(port=0, http_port=0),
                       scheduler=SchedulerConfig(port=0, **scheduler),
                       workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=kv_cache_mb)], model=model)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(cluster_config(), quiet=True) as running:
        yield running


def run(coro):
    return asyncio.run(coro)
