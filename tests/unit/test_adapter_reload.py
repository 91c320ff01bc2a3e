"""Loading a LoRA adapter again under its name with new weights (a reload) through the pool's
scheduler (services/scheduler/pool_adapters.py), against simulated workers whose "weights" are a
version number: every computed position records the version it was computed under, a sampled
token depends on the version, and a sequence that reads back a position computed under another
version than the one it computes with now is counted (a stale read). Pure Python (no torch)."""
from __future__ import annotations

import asyncio

import pytest

from services.common.errors import ErrorKind, ServiceError
from services.common.kv_blocks import blocks_for_tokens
from services.common.priority import HIGH, LOW, MEDIUM
from services.common.proto.qos.v1 import worker_pb2
from services.common.step import FinishReason, SampledToken
from services.common.wire import answer_tokens
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.policy import QoSSettings, create_policy
from services.scheduler.pool_adapters import PoolAdapters
from services.scheduler.prefix_cache import PrefixCache
from tests.unit.test_batcher import drain, next_token
from tests.unit.test_prefix_scheduling import BLOCK, CAPS, CachingWorker, request

SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]      # three full blocks


def versioned_token(tokens: list[int], version: int) -> int:
    return (next_token(tokens) + 11 * version) % 97 + 3


def expected(prompt: list[int], max_tokens: int, version: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(versioned_token(tokens, version))
    return tokens[len(prompt):]


class VersionedWorker(CachingWorker):
    """A caching worker whose adapters are versions ("v2" loads version 2), swapped whenever asked
    (as a worker did before it refused swaps under running sequences): what keeps K/V apart is
    the scheduler's doing. `load_gate` holds a load; `step_gate` holds steps."""

    def __init__(self, index: int, num_blocks: int, make_pool, weights: dict[str, int]):
        super().__init__(index, num_blocks, make_pool)
        self.weights = dict(weights)
        self.adapters = frozenset(self.weights)
        self.load_gate, self.step_gate = asyncio.Event(), asyncio.Event()
        self.load_gate.set()
        self.step_gate.set()
        self.loading, self.in_step = asyncio.Event(), asyncio.Event()
        self.stale_reads = 0
        self.fail_loads = False

    def restart(self) -> None:
        super().restart()
        self.kv: dict[int, tuple[int, int, object]] = {}

    def version_of(self, lora: str):
        return (lora, self.weights[lora]) if lora else None

    async def load_adapter(self, name: str, path: str) -> worker_pb2.LoadAdapterReply:
        self.loading.set()
        await self.load_gate.wait()
        if self.fail_loads:
            raise ServiceError(ErrorKind.INVALID, f"{path}: no adapter_config.json", field="path")
        self.weights[name] = int(path.removeprefix("v"))
        self.adapters = frozenset(self.weights)
        return worker_pb2.LoadAdapterReply()

    async def unload_adapter(self, name: str) -> None:
        del self.weights[name]
        self.adapters = frozenset(self.weights)

    async def execute(self, plan: worker_pb2.StepPlan, sent=None) -> worker_pb2.StepResult:
        if sent is not None and not sent.done():
            sent.set_result(None)
        self.in_step.set()
        await self.step_gate.wait()
        self.plans.append(plan)
        batch = self.table.apply(plan)
        tokens = []
        for work in batch.sequences:
            assert blocks_for_tokens(work.end, BLOCK) <= len(work.block_table)
            version = self.version_of(work.lora)
            for offset, token in enumerate(work.token_ids):
                position = work.position + offset
                self.kv[work.block_table[position // BLOCK] * BLOCK + position % BLOCK] = (position, token, version)
            if work.sample:
                read = [self.kv[work.block_table[p // BLOCK] * BLOCK + p % BLOCK] for p in range(work.end)]
                assert all(entry[0] == p for p, entry in enumerate(read))
                self.stale_reads += sum(1 for entry in read if entry[2] != version)
                token = versioned_token([t for _, t, _ in read], version[1] if version else 0)
                reason = FinishReason.LENGTH if work.num_generated + 1 >= work.sampling.max_tokens else None
                tokens.append(SampledToken(work.seq_id, token, reason))
        self.table.commit(batch, tokens)
        return answer_tokens(worker_pb2.StepResult(step_id=plan.step_id), tokens, plan.packed_results)


def pool_with(workers: int = 1, version: int = 1):
    cache = PrefixCache({HIGH: 1.0, MEDIUM: 0.5, LOW: 0.2})
    policy = create_policy("qos", QoSSettings(kv_caps=dict(CAPS), high_cut_in=False))
    batcher = ContinuousBatcher("sim", [], policy, 6, 12, prefix_cache=cache)
    links = [VersionedWorker(i, 48, batcher.make_pool, {"A": version}) for i in range(workers)]
    for link in links:
        batcher.workers.add(link)
        batcher.planner.add_worker(link.index)
    return batcher, links, PoolAdapters("sim", batcher)


def with_adapter(seq_id: int, prompt: list[int], max_tokens: int, lora: str = "A"):
    r = request(seq_id, prompt, max_tokens)
    r.lora = lora
    return r


async def finished(batcher, r, submit: bool = True) -> list[int]:
    if submit:
        batcher.submit(r)
    tokens, _, last = await asyncio.wait_for(drain(r), 10)
    assert getattr(last, "finish_reason", None), f"{r.request_id} failed: {last}"
    return tokens


def test_no_block_computed_under_the_old_weights_is_read_after_a_reload():
    """A prefix computed under v1; the reload to v2 waits on the worker while a request naming
    the adapter arrives: it is held until the swap, then computed under v2, and the request after
    it shares its blocks (v2's), never v1's."""
    async def scenario():
        batcher, (worker,), adapters = pool_with()
        loop = asyncio.create_task(batcher.run())
        try:
            r0 = with_adapter(1, SYSTEM + [5], 3)
            assert await finished(batcher, r0) == expected(r0.prompt_ids, 3, version=1)
            worker.load_gate.clear()
            reload = asyncio.create_task(adapters.load("A", "v2"))
            await asyncio.wait_for(worker.loading.wait(), 5)
            r1 = with_adapter(2, SYSTEM + [6], 3)
            batcher.submit(r1)
            await asyncio.sleep(0.1)              # steps go on while the worker swaps
            worker.load_gate.set()
            await asyncio.wait_for(reload, 5)
            out1 = await finished(batcher, r1, submit=False)
            r2 = with_adapter(3, SYSTEM + [7], 3)
            out2 = await finished(batcher, r2)
            return worker, (r1, out1), (r2, out2)
        finally:
            loop.cancel()

    worker, (r1, out1), (r2, out2) = asyncio.run(scenario())
    assert worker.stale_reads == 0
    assert out1 == expected(r1.prompt_ids, 3, version=2) and r1.cached_tokens == 0
    assert out2 == expected(r2.prompt_ids, 3, version=2) and r2.cached_tokens == len(SYSTEM)


def test_a_reload_is_refused_while_a_request_runs_or_waits_with_the_adapter():
    async def scenario():
        batcher, (worker,), adapters = pool_with()
        queued = with_adapter(1, SYSTEM + [5], 4)
        batcher.submit(queued)                    # the loop is not running yet: it waits
        with pytest.raises(ServiceError) as waiting:
            await adapters.load("A", "v2")
        worker.step_gate.clear()
        loop = asyncio.create_task(batcher.run())
        try:
            await asyncio.wait_for(worker.in_step.wait(), 5)      # admitted: its first step is out
            with pytest.raises(ServiceError) as running:
                await adapters.load("A", "v2")
            worker.step_gate.set()
            out = await finished(batcher, queued, submit=False)
            await adapters.load("A", "v2")        # nothing uses it now
            later = with_adapter(2, SYSTEM + [5], 4)
            return waiting.value, running.value, (queued, out), (later, await finished(batcher, later)), worker
        finally:
            loop.cancel()

    waiting, running, (first, out), (later, out_later), worker = asyncio.run(scenario())
    for error, counts in ((waiting, "0 running and 1 queued"), (running, "1 running and 0 queued")):
        assert error.kind is ErrorKind.CONFLICT and error.reason == "adapter_in_use"
        assert "'A'" in error.message and counts in error.message and "once they finish" in error.message
        assert error.retry_after_ms
    assert out == expected(first.prompt_ids, 4, version=1)        # never switched under it
    assert out_later == expected(later.prompt_ids, 4, version=2) and later.cached_tokens == 0
    assert worker.stale_reads == 0


def test_a_worker_that_cannot_load_the_new_weights_drops_the_old_and_is_not_given_the_adapter():
    async def scenario():
        batcher, workers, adapters = pool_with(workers=2)
        workers[1].fail_loads = True
        loop = asyncio.create_task(batcher.run())
        try:
            reply = await adapters.load("A", "v2")
            requests = [with_adapter(i, SYSTEM + [i], 3) for i in range(1, 5)]
            outs = await asyncio.gather(*(finished(batcher, r) for r in requests))
            return reply, requests, outs, workers
        finally:
            loop.cancel()

    reply, requests, outs, workers = asyncio.run(scenario())
    assert [m.split(":")[0] for m in reply.missing_on] == ["sim-1"]
    assert "A" not in workers[1].weights and workers[0].weights == {"A": 2}
    assert all(out == expected(r.prompt_ids, 3, version=2) for r, out in zip(requests, outs))
    assert not any(n.lora for plan in workers[1].plans for n in plan.new_sequences)
