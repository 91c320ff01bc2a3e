"""End to end over real loopback gRPC: router -> scheduler -> worker, three processes."""
from __future__ import annotations

import asyncio
import random

import pytest

from services.common.proto.qos.v1 import (
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.step import SamplingParams
from services.common.tokenizer import TextTokenizer
from services.engine.batch_runner import BatchRunner, GenerationRequest
from services.engine.engine import Engine, EngineConfig
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import assert_continues, run, worker_dtype

pytestmark = pytest.mark.slow

QUESTIONS = ["What is {n} plus {n}?", "Name {n} animals.", "Write a sentence about the number {n}.",
             "Why is the sky blue? Answer in {n} words.", "Count from {n} to {m}.",
             "Give {n} reasons to learn Python."]
MAX_TOKENS = 16


def prompts(count: int) -> list[str]:
    rng = random.Random(11)
    return [rng.choice(QUESTIONS).format(n=rng.randint(2, 9), m=rng.randint(10, 20)) for _ in range(count)]


def test_concurrent_mixed_priority_streams_match_the_engine(cluster):
    """30 greedy streams batched together. In any dtype each is the model's greedy text for its
    own prompt, up to the dtype's rounding; in fp32 (numbers independent of the batch) each
    equals, token for token, what the engine gives the prompts in one batch of its own."""
    texts = prompts(30)
    priorities = ["high", "medium", "low"] * 10

    async def go():
        async with RouterClient(cluster.router_address) as client:
            answers = await asyncio.gather(*[
                client.generate(chat_request(t, sampling_params(max_tokens=MAX_TOKENS, temperature=0.0)),
                                priority=p, tenant="test") for t, p in zip(texts, priorities)])
            return answers, await worker_dtype(cluster)

    answers, dtype = run(go())
    assert all(a.finish_reason in ("stop", "length") for a in answers)
    tokenizer = TextTokenizer.from_model_dir(cluster.config.model)
    prompt_ids = [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    for text, answer, ids in zip(texts, answers, prompt_ids):
        assert answer.pool == "cpu" and answer.text == tokenizer.decode(answer.token_ids), text
        assert_continues(cluster.config.model, dtype, ids, answer.token_ids, text)
    if dtype != "float32":
        return
    # The same prompts straight through the engine, in this process.
    engine = Engine(EngineConfig(model_dir=cluster.config.model, num_threads=1, dtype="fp32",
                                 kv_cache_bytes=128 * 2**20))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    direct = BatchRunner(engine, max_running=30).run([GenerationRequest(ids, params) for ids in prompt_ids])
    for text, answer, reference in zip(texts, answers, direct):
        assert answer.token_ids == reference.token_ids, text


def test_cancelled_streams_free_their_blocks_and_worker_state(cluster):
    async def go():
        async with RouterClient(cluster.router_address) as client:
            calls = [client.stream(chat_request(t, sampling_params(max_tokens=400, ignore_eos=True)),
                                   priority="low") for t in prompts(20)]

            async def read_two_then_cancel(call):
                seen = 0
                async for chunk in call:
                    seen += len(chunk.token_ids)
                    if seen >= 2:
                        call.cancel()
                        return seen
                return seen

            seen = await asyncio.gather(*(read_two_then_cancel(c) for c in calls))
            assert all(s >= 2 for s in seen)

        for _ in range(100):
            pool = await cluster.pool_stats()
            if pool.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.05)
        trust = cluster.trust
        async with trust.channel(cluster.config.pools[0].workers[0].address, "worker") as channel:
            worker = worker_pb2_grpc.WorkerStub(channel)
            for _ in range(100):   # released with the scheduler's next plan, sent at once
                info = await worker.Info(worker_pb2.InfoRequest(), metadata=trust.metadata)
                if info.active_sequences == 0:
                    break
                await asyncio.sleep(0.05)
        return pool, info

    pool, info = run(go())
    assert pool.kv_blocks_used == 0
    assert sum(c.running + c.waiting for c in pool.classes) == 0
    assert info.active_sequences == 0


def test_seeded_sampling_through_the_stack_is_reproducible(cluster):
    request = chat_request("Tell me a story.", sampling_params(max_tokens=12, temperature=0.8, seed=7))

    async def go():
        async with RouterClient(cluster.router_address) as client:
            return await asyncio.gather(*[client.generate(request) for _ in range(3)])

    answers = run(go())
    assert answers[0].token_ids == answers[1].token_ids == answers[2].token_ids


def test_stop_strings_end_the_text_before_them(cluster):
    async def go():
        async with RouterClient(cluster.router_address) as client:
            full = await client.generate(chat_request("Count from 1 to 10.",
                                                      sampling_params(max_tokens=40, temperature=0.0)))
            stop = full.text[len(full.text) // 3:len(full.text) // 3 + 2]
            cut = await client.generate(chat_request("Count from 1 to 10.", sampling_params(
                max_tokens=40, temperature=0.0, stop=[stop])))
            return full, cut, stop

    full, cut, stop = run(go())
    assert stop and cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index(stop)]
