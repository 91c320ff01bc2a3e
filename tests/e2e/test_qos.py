"""QoS through the real gRPC stack: preemption keeps streams exact, admission rules, Stats."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.priority import LOW
from services.common.proto.qos.v1 import scheduler_pb2
from services.common.step import SamplingParams
from services.common.tokenizer import TextTokenizer
from services.engine.batch_runner import BatchRunner, GenerationRequest
from services.engine.engine import Engine, EngineConfig
from services.local.cluster import LocalCluster
from services.tools.client import RouterClient, chat_request, sampling_params
from bench.continuation import DTYPE_NAMES
from services.common.kv_blocks import cap_blocks
from tests.e2e.conftest import TEST_DTYPE, assert_continues, cluster_config, run

pytestmark = pytest.mark.slow


def small_cluster(kv_cache_mb: int, dtype: str | None = TEST_DTYPE, **scheduler) -> LocalCluster:
    return LocalCluster(cluster_config(kv_cache_mb=kv_cache_mb, dtype=dtype, **scheduler), quiet=True)


async def pool_stats(cluster) -> scheduler_pb2.PoolStats:
    return await cluster.pool_stats()


# KV budgets that make 11 blocks of 16 tokens of SmolLM2-135M in each dtype (46,080 bytes a token
# in fp32, half in bf16).
KV_MB_FOR_11_BLOCKS = {"fp32": 8, "bf16": 4}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_high_preempts_low_and_every_stream_continues_exactly(dtype):
    """In every dtype the preempted stream continues from exactly the tokens its client holds;
    in fp32, where the numbers do not depend on the batch, every text also equals the one each
    request gets alone and unpreempted."""
    # 11 blocks of 16 tokens: Low may hold 3, Medium 7. One Low and two Medium answers hold 9; a
    # High request then needs 3 more and takes them from Low. Without prefix caching: shared,
    # the chat template's opening blocks would count once and leave room.
    with small_cluster(kv_cache_mb=KV_MB_FOR_11_BLOCKS[dtype], dtype=dtype, prefix_caching=False) as cluster:
        greedy = sampling_params(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = {"low": "Count to five.", "medium": "Name a fruit.", "medium2": "Say something nice.",
                   "high": "Hi!"}

        async def go():
            async with RouterClient(cluster.router_address) as client:
                started = {name: asyncio.Event() for name in prompts}

                async def ask(name, priority):
                    answer = await client.generate(chat_request(prompts[name], greedy), priority=priority,
                                                   on_text=lambda _: started[name].set())
                    started[name].set()
                    return answer

                background = [asyncio.create_task(ask("low", "low")),
                              asyncio.create_task(ask("medium", "medium")),
                              asyncio.create_task(ask("medium2", "medium"))]
                await asyncio.gather(*(started[n].wait() for n in ("low", "medium", "medium2")))
                high = await ask("high", "high")
                return [*await asyncio.gather(*background), high], await pool_stats(cluster)

        answers, stats = run(go())
        assert stats.kv_blocks_total == 11 and {m.dtype for m in stats.members} == {DTYPE_NAMES[dtype]}
        assert stats.preemptions >= 1
        low_stats = next(c for c in stats.classes if c.priority == LOW)
        assert low_stats.preempted >= 1

        tokenizer = TextTokenizer.from_model_dir(cluster.config.model)
        names = ["low", "medium", "medium2", "high"]
        prompt_ids = [tokenizer.encode_chat([{"role": "user", "content": prompts[n]}]) for n in names]
        for name, answer, ids in zip(names, answers, prompt_ids):
            assert len(answer.token_ids) == 12 and answer.text == tokenizer.decode(answer.token_ids), name
            assert_continues(cluster.config.model, dtype, ids, answer.token_ids, name)
        if dtype == "fp32":
            engine = Engine(EngineConfig(model_dir=cluster.config.model, num_threads=1, dtype="fp32",
                                         kv_cache_bytes=32 * 2**20))
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            direct = BatchRunner(engine, max_running=1).run([GenerationRequest(ids, params) for ids in prompt_ids])
            for name, answer, reference in zip(names, answers, direct):
                assert answer.token_ids == reference.token_ids, name


@pytest.fixture(scope="module")
def tight_cluster():
    # 32 MiB = 45 blocks in fp32 (Low may hold 13, 208 tokens), 91 in bf16 (Low 27); at most 2
    # requests wait per class.
    # Chunks held for their stream interval as long as it takes (test_stream_intervals_...).
    with small_cluster(kv_cache_mb=32, max_queue=2, retry_after_ms=750, stream_max_hold_ms=60_000) as cluster:
        yield cluster


async def outcome(client, prompt, priority, max_tokens, slo_ms=None):
    try:
        answer = await client.generate(chat_request(prompt, sampling_params(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True)), priority=priority, slo_ms=slo_ms)
        return grpc.StatusCode.OK, answer, ()
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details(), tuple(exc.trailing_metadata() or ())


def test_kv_need_over_the_class_cap_is_refused_at_once(tight_cluster):
    stats = run(pool_stats(tight_cluster))       # the pool's size follows the dtype its worker runs
    low_cap = cap_blocks(stats.kv_blocks_total, 0.3)
    over_the_cap = low_cap * stats.block_size    # with the prompt, more tokens than Low's blocks hold

    async def go():
        async with RouterClient(tight_cluster.router_address) as client:
            return (await outcome(client, "Write a long story.", "low", over_the_cap),
                    await outcome(client, "Write a long story.", "high", 5))

    (code, details, _), (high_code, _, _) = run(go())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"the low class may hold at most {low_cap} " in details
    assert high_code == grpc.StatusCode.OK


def test_queue_overflow_is_refused_with_retry_after(tight_cluster):
    async def go():
        async with RouterClient(tight_cluster.router_address) as client:
            # Sent at once, all 14 arrive well before the first finishes (24 tokens): Low runs 3
            # of these (~60 tokens, 4 blocks each) within its 13 blocks, 2 more may wait, and the
            # rest must be refused rather than queued without bound.
            return await asyncio.gather(*[outcome(client, f"Tell me about {i}.", "low", 24)
                                          for i in range(14)])

    results = run(go())
    refused = [(d, t) for code, d, t in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    served = [a for code, a, _ in results if code == grpc.StatusCode.OK]
    assert refused and served
    for details, trailers in refused:
        assert "the low queue of pool cpu is full" in details
        assert ("retry-after-ms", "750") in trailers


def test_slo_that_cannot_be_met_is_refused(tight_cluster):
    async def go():
        async with RouterClient(tight_cluster.router_address) as client:
            await outcome(client, "Warm up.", "medium", 8)           # the pool learns its token rate
            busy = [asyncio.create_task(outcome(client, f"Story {i}", "medium", 60)) for i in range(6)]
            await asyncio.sleep(0.5)
            tight = await outcome(client, "Quick question?", "medium", 4, slo_ms=1)
            loose = await outcome(client, "Quick question?", "high", 4, slo_ms=600_000)
            await asyncio.gather(*busy)
            return tight, loose

    (code, details, trailers), (loose_code, _, _) = run(go())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds x-slo-ms=1" in details
    assert any(k == "retry-after-ms" for k, _ in trailers)
    assert loose_code == grpc.StatusCode.OK


def test_invalid_slo_header_is_invalid_argument(tight_cluster):
    async def go():
        async with grpc.aio.insecure_channel(tight_cluster.router_address) as channel:
            from services.common.proto.qos.v1 import router_pb2_grpc
            call = router_pb2_grpc.RouterStub(channel).Generate(
                chat_request("Hi", sampling_params(max_tokens=2)), metadata=[("x-slo-ms", "soon")])
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()

    code, details = run(go())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "x-slo-ms 'soon'" in details


def test_stats_show_policy_weights_and_caps(tight_cluster):
    stats = run(pool_stats(tight_cluster))
    assert stats.policy == "qos"
    by_priority = {c.priority: c for c in stats.classes}
    assert [by_priority[p].weight for p in (1, 2, 3)] == [5, 3, 2]
    assert [round(by_priority[p].kv_cap, 2) for p in (1, 2, 3)] == [1.0, 0.7, 0.3]
    assert by_priority[3].rejected >= 1      # from the tests above


def test_router_stats_show_the_pool_weights_and_counts(tight_cluster):
    from services.common.proto.qos.v1 import router_pb2, router_pb2_grpc

    async def go():
        async with grpc.aio.insecure_channel(tight_cluster.router_address) as channel:
            return await router_pb2_grpc.RouterStub(channel).Stats(router_pb2.StatsRequest())

    stats = run(go())
    (pool,) = stats.pools
    assert pool.policy == "qos" and [c.weight for c in pool.classes] == [5, 3, 2]
    by_priority = {p.priority: p for p in stats.priorities}
    assert by_priority[LOW].requests >= 14
    assert by_priority[LOW].failed >= 1


def test_stream_intervals_by_class_and_by_request(tight_cluster):
    """Low streams send 16 tokens a chunk after the first (the pool's default), High one, and
    x-stream-interval sets it for a request. Chunks only grow when a stream falls behind (the
    Submit handler merges queued ones), so every chunk between the first and the last carries
    at least the interval."""
    request = chat_request("Count to fifty.", sampling_params(max_tokens=40, temperature=0.0, ignore_eos=True))

    async def sizes(client, metadata):
        return [len(c.token_ids) async for c in client.stub.Generate(request, metadata=metadata)]

    async def go():
        async with RouterClient(tight_cluster.router_address) as client:
            return [await sizes(client, m) for m in (
                [("x-priority", "low")], [("x-priority", "high"), ("x-stream-interval", "8")],
                [("x-priority", "low"), ("x-stream-interval", "1")])]

    low, high_by_eight, low_by_one = run(go())
    assert sum(low) == sum(high_by_eight) == sum(low_by_one) == 40
    assert low[0] == high_by_eight[0] == 1                      # the first token goes alone
    assert all(n >= 16 for n in low[1:-1]) and len(low) <= 1 + 3     # 39 tokens in chunks of >= 16
    assert all(n >= 8 for n in high_by_eight[1:-1]) and len(high_by_eight) <= 1 + 5
    assert len(low_by_one) > 4                                  # per token, unless it fell behind
