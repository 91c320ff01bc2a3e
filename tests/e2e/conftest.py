"""A real local cluster (router, scheduler, CPU worker as separate processes on loopback).

Clusters serve the embedded SmolLM2-135M unless a test only needs load, not text worth reading:
those pass model=bench_model(), the QoS benchmark's 4-layer random-weight Llama with the same
tokenizer and architecture (services/engine/bench_model.py), whose steps are ~5x cheaper on one
thread. That keeps `make test` within its 15 minutes on 2 cores.

Dtype: a test cluster's workers run the host's choice (bf16 where the CPU multiplies bf16
natively, else fp32) unless QOS_TEST_DTYPE names one (fp32 or bf16: .ci/run's dtype legs set it)
or the test pins it. A fault test asserts texts equal to the undisturbed run's where the worker's
numbers are batch-invariant (texts_are_batch_invariant: fp32, and bf16 where the linear and
attention kernels run it); elsewhere a stream is checked to continue from exactly the tokens the
client holds (bench/continuation.py)."""
from __future__ import annotations

import asyncio
import functools
import os

import pytest

from services.common.config import ClusterConfig, RouterConfig, SchedulerConfig, WorkerConfig, single_pool
from services.engine.bench_model import CONFIG as BENCH_CONFIG
from services.local.cluster import LocalCluster


@functools.cache
def bench_model() -> str:
    from services.engine.bench_model import bench_model_dir  # built once from the default model, cached
    return str(bench_model_dir())


# A random-weight Llama that writes text a token does not repeat in (SmolLM2's tokenizer, 2 layers
# of 128, weights at 10x the usual spread): the bench model's greedy text repeats a token or two, so
# a lost or repeated token would not show in it, and SmolLM2 is slow where bf16 is emulated (a step
# of 8 prompts past 2 s on one thread of a CPU without avx512_bf16). Measured on this one in bf16:
# 8 streams x 48 greedy tokens all distinct; 736 of 736 dropped or repeated tokens caught by
# bench/continuation.py, honest streams 0 ulps short.
TEXT_MODEL_CONFIG = {**BENCH_CONFIG, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}


@functools.cache
def text_model() -> str:
    from services.common.paths import cache_root
    from services.engine.bench_model import build_bench_model
    target = cache_root() / "models" / "qos-test-text-llama-2L-128"
    if not (target / "config.json").is_file():
        build_bench_model(target, TEXT_MODEL_CONFIG, std=0.2, seed=7)
    return str(target)


TEST_DTYPE: str | None = os.environ.get("QOS_TEST_DTYPE") or None


@functools.cache
def texts_are_batch_invariant(dtype: str) -> bool:
    """Whether the fault tests' workers (default settings) keep greedy texts equal to an
    undisturbed run's on this host (bench/continuation.py)."""
    from bench.continuation import texts_equal_undisturbed
    return texts_equal_undisturbed(dtype)


def cluster_config(kv_cache_mb: int = 256, model: str = "default", dtype: str | None = TEST_DTYPE,
                   workers: int = 1, **scheduler) -> ClusterConfig:
    """One pool of `workers` workers (1 thread each, in `dtype`; None: the host's choice)."""
    return single_pool(router=RouterConfig(port=0, http_port=0),
                       scheduler=SchedulerConfig(port=0, **scheduler),
                       workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=kv_cache_mb, dtype=dtype)
                                for _ in range(workers)], model=model)


@functools.cache
def greedy_checker(model: str, dtype: str):
    from bench.continuation import GreedyChecker
    return GreedyChecker(model, dtype)


def assert_continues(model: str, dtype: str, prompt_ids, token_ids, name: str = "") -> None:
    """Every token the client holds is the greedy choice for the prompt and the tokens before it,
    within the dtype's rounding: no token lost, none repeated, the continuation computed from
    exactly what was already sent (bench/continuation.py)."""
    broken = greedy_checker(model, dtype).broken_at(prompt_ids, token_ids)
    assert broken is None, f"{name}: token {broken} of {list(token_ids)} is no greedy choice after the ones before it"


def openai_client(cluster: LocalCluster, timeout: float = 120):
    """The official `openai` client on the cluster's HTTP front (no retries: a test sees every
    answer as it came); use it as a context manager."""
    import openai
    router = cluster.config.router
    return openai.OpenAI(base_url=f"http://{router.host}:{router.http_port}/v1", api_key="unused",
                         max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def client(cluster):
    """The official client on the module's `cluster` fixture (modules that need a longer timeout
    define their own)."""
    with openai_client(cluster) as api:
        yield api


@pytest.fixture(scope="module")
def model(client) -> str:
    """The model the module's cluster serves, as /v1/models names it."""
    return client.models.list().data[0].id


async def worker_dtype(cluster: LocalCluster, pool: str | None = None) -> str:
    """The dtype the pool's workers report running ("float32", "bfloat16")."""
    dtypes = {m.dtype for m in (await cluster.pool_stats(pool)).members if m.connected}
    assert len(dtypes) == 1, dtypes
    return dtypes.pop()


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(cluster_config(), quiet=True) as running:
        yield running


@pytest.fixture(scope="session")
def fp32_cluster():
    """One default fp32 cluster shared by the modules that compare exact tokens and leave it as they
    found it (no kills, drains, adapters or settings of their own; counters read as differences):
    a cluster start (~4 s) saved for each but the first. Stopped at the session's end."""
    with LocalCluster(cluster_config(dtype="fp32"), quiet=True) as running:
        yield running


def run(coro):
    return asyncio.run(coro)
