"""No lost request, with real processes: a worker SIGKILLed mid-stream (its sequences finish on
the other worker), a worker joining at run time, a worker restarted within the grace, and a pool
whose scheduler dies (its requests move to another pool with the tokens already streamed).

What a fault leaves a stream depends on the numbers (FAULT_MODELS): in every dtype it continues
from exactly the tokens its client holds; in fp32 it is also the text it would have had
undisturbed, token for token."""
from __future__ import annotations

import asyncio
import signal
import sys

import grpc
import pytest

from services.common.config import ClusterConfig, PoolConfig, RouterConfig, SchedulerConfig, WorkerConfig
from services.common.proto.qos.v1 import router_pb2, router_pb2_grpc, scheduler_pb2
from services.common.tokenizer import TextTokenizer
from services.local.cluster import LocalCluster
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import assert_continues, bench_model, cluster_config, run, text_model, texts_are_batch_invariant

pytestmark = pytest.mark.slow

TOKENS = 48
STORIES = [f"Write a short story about a {thing}." for thing in
           ("lighthouse", "dragon", "robot", "garden", "river", "violin", "comet", "bakery",
            "glacier", "train", "owl", "desert", "library", "volcano", "kite", "harbour")]


def request(i: int):
    return chat_request(STORIES[i], sampling_params(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))


async def pool_stats(cluster: LocalCluster, pool: str | None = None) -> scheduler_pb2.PoolStats:
    return await cluster.pool_stats(pool)


async def until(check, timeout: float = 60.0, every: float = 0.1):
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(every)


async def texts(client: RouterClient, count: int, while_streaming=None, priority: str = "medium"):
    """`count` greedy streams at once; `while_streaming()` runs once each has streamed 3 tokens."""
    started = [asyncio.Event() for _ in range(count)]

    async def one(i: int):
        call = client.stream(request(i), priority=priority)
        tokens, text, last = [], "", None
        async for chunk in call:
            tokens += chunk.token_ids
            text += chunk.text
            last = chunk
            if len(tokens) >= 3:
                started[i].set()
        return tokens, text, last

    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    if while_streaming is not None:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        await while_streaming()
    return await asyncio.wait_for(asyncio.gather(*tasks), 300)


def assert_same(reference, got) -> None:
    for (ref_tokens, ref_text, _), (tokens, text, last) in zip(reference, got):
        assert last.finish_reason and last.usage.completion_tokens == TOKENS == len(tokens)
        assert tokens == ref_tokens and text == ref_text


# The model each dtype's fault tests run. fp32: the random-weight bench model (cheap steps), the
# workers' default settings. bf16: a random-weight model whose greedy text never repeats a token
# (conftest.text_model; in the bench model's a lost or repeated token would not show), with the
# workers' default settings too. Where the numbers are batch-invariant (services/engine/
# step_layout.py; conftest.texts_are_batch_invariant: fp32; bf16 on a CPU whose kernels run it)
# every text must equal the undisturbed run's; elsewhere every stream must continue from exactly
# the tokens its client held, and its text may part from the undisturbed one at a near-tie. Both
# stay cheap where bf16 is emulated.
FAULT_MODELS = {"fp32": bench_model, "bf16": text_model}
DTYPES = ["fp32", "bf16"]


def fault_config(dtype: str, workers: int = 2, **scheduler) -> ClusterConfig:
    return cluster_config(model=FAULT_MODELS[dtype](), dtype=dtype, workers=workers, kv_cache_mb=128, **scheduler)


def assert_held(reference, got, model: str, dtype: str) -> None:
    """Every stream finished whole: where texts are batch-invariant, equal to the undisturbed
    `reference`; in any dtype each token the greedy choice after exactly the tokens before it (no
    gap, no repeat)."""
    if texts_are_batch_invariant(dtype):
        assert_same(reference, got)
        return
    tokenizer = TextTokenizer.from_model_dir(model)
    for i, (tokens, text, last) in enumerate(got):
        assert last.finish_reason and last.usage.completion_tokens == TOKENS == len(tokens)
        assert text == tokenizer.decode(tokens), STORIES[i]
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": STORIES[i]}])
        assert_continues(model, dtype, prompt_ids, tokens, STORIES[i])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_killed_workers_streams_finish_on_the_other_and_a_third_joins(dtype):
    # Prefix caching sends requests to the worker holding their prefix (here the chat template's
    # opening, shared by all) until load wins; at margin 0 any difference in load wins, so the
    # streams spread over the workers, the newcomer's included.
    config = fault_config(dtype, cache_affinity_margin=0.0)
    with LocalCluster(config, quiet=True) as cluster:
        async def go():
            async with RouterClient(cluster.router_address) as client:
                reference = await texts(client, 16)

                async def kill_one():       # the worker with the most streams on it
                    members = (await pool_stats(cluster)).members
                    busiest = max(members, key=lambda m: m.running)
                    assert busiest.running, "no stream on any worker"
                    index = [w.address for w in config.pools[0].workers].index(busiest.address)
                    cluster.processes[f"cpu/worker-{index}"].send_signal(signal.SIGKILL)

                got = await texts(client, 16, kill_one)
                stats = await pool_stats(cluster)
                # A third worker joins at run time and takes new sequences.
                cluster._spawn("cpu/worker-joined", "worker", "--pool", "cpu", "--index", "0",
                               "--port", "0", "--join", cluster.scheduler_address)

                async def joined():
                    s = await pool_stats(cluster)
                    return s.workers == 2 and len(s.members) == 3
                await until(joined)
                before = await pool_stats(cluster)
                again = await texts(client, 16)
                after = await pool_stats(cluster)
                return reference, got, stats, before, again, after

        reference, got, stats, before, again, after = run(go())
    assert_held(reference, got, cluster.config.model, dtype)
    assert stats.failovers > 0 and stats.kv_blocks_used == 0 and stats.workers == 1
    assert not any(c.running or c.waiting for c in stats.classes)
    assert_held(reference, again, cluster.config.model, dtype)
    assert after.kv_blocks_total == before.kv_blocks_total > stats.kv_blocks_total
    configured = {w.address for w in config.pools[0].workers}
    (newcomer,) = [m for m in after.members if m.address not in configured]
    assert newcomer.connected and newcomer.admitted > 0, "the worker that joined took no sequence"


def test_the_only_worker_restarted_within_the_grace_finishes_every_stream():
    config = cluster_config(orphan_grace_s=120.0, model=bench_model(), dtype="fp32")   # texts compared: fp32
    with LocalCluster(config, quiet=True) as cluster:
        async def go():
            async with RouterClient(cluster.router_address) as client:
                reference = await texts(client, 6)

                async def kill_and_restart():
                    process = cluster.processes["cpu/worker-0"]
                    process.send_signal(signal.SIGKILL)
                    process.wait()
                    cluster.start_worker("cpu", 0)

                return reference, await texts(client, 6, kill_and_restart)

        reference, got = run(go())
    assert_same(reference, got)


def two_pools(dtype: str) -> ClusterConfig:
    def pool(name: str, primary: bool) -> PoolConfig:
        return PoolConfig(name=name, device="cpu", primary=primary,
                          scheduler=SchedulerConfig(port=0, max_step_tokens=128),
                          workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=128, dtype=dtype)])
    return ClusterConfig(router=RouterConfig(port=0, http_port=0, routing="primary"), model=FAULT_MODELS[dtype](),
                         pools=[pool("first", True), pool("second", False)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_dead_schedulers_requests_move_to_the_other_pool_with_what_they_streamed(dtype):
    with LocalCluster(two_pools(dtype), quiet=True) as cluster:

        async def go():
            async with RouterClient(cluster.router_address) as client:
                reference = await texts(client, 8, priority="high")

                async def kill_first():
                    assert (await pool_stats(cluster, "first")).classes[0].running > 0
                    cluster.processes["first/scheduler"].send_signal(signal.SIGKILL)

                got = await texts(client, 8, kill_first, priority="high")
                async with grpc.aio.insecure_channel(cluster.router_address) as channel:
                    stats = await router_pb2_grpc.RouterStub(channel).Stats(router_pb2.StatsRequest())
                return reference, got, stats

        reference, got, stats = run(go())
    assert_held(reference, got, cluster.config.model, dtype)
    assert {last.pool for _, _, last in got} == {"second"}
    by_pool = {g.name: g for g in stats.by_pool}
    assert (by_pool["second"].completed, by_pool["first"].completed, by_pool["first"].failed) == (8, 8, 8)
    assert stats.migrations == 8 and stats.priorities[0].completed == 16 and stats.priorities[0].failed == 0


def test_qos_serve_drain_worker_scales_in_without_losing_a_stream():
    config = fault_config("fp32")       # texts compared with a run batched otherwise: fp32
    with LocalCluster(config, quiet=True) as cluster:
        address = cluster.config.pools[0].workers[1].address
        drained = {}

        async def go():
            async with RouterClient(cluster.router_address) as client:
                reference = await texts(client, 8)

                async def drain_one():
                    drained["command"] = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "services.tools.cli", "drain", "worker", address, "--wait", "60",
                        "--config", str(cluster.config_path),
                        stdout=asyncio.subprocess.PIPE)

                got = await texts(client, 8, drain_one)
                out, _ = await drained["command"].communicate()
                return reference, got, out.decode(), drained["command"].returncode

        reference, got, out, code = run(go())
        worker_exit = cluster.processes["cpu/worker-1"].wait(timeout=30)
        stats = run(pool_stats(cluster))
    assert_same(reference, got)
    assert code == 0 and f"worker {address} has left" in out and worker_exit == 0
    assert stats.workers == 1 and stats.failovers == 0     # its sequences finished there
