"""Requests that share a prefix being computed (services/scheduler/prefix_in_flight.py): a burst
computes the shared blocks once, a follower waits only behind a leader of its class or a more
urgent one, and a leader that leaves strands no one. Simulated caching workers (exact outputs
prove the sharing right); pure Python."""
from __future__ import annotations

import asyncio
import random

from services.common.priority import HIGH, LOW, MEDIUM
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.policy import QoSSettings, create_policy
from services.scheduler.prefix_cache import PrefixCache
from tests.unit.test_batcher import drain
from tests.unit.test_prefix_scheduling import BLOCK, CAPS, CachingWorker, expected, request

PREFIX = 40          # tokens: 10 blocks, several steps of a 12-token budget


def cluster(max_step_tokens: int = 12, num_blocks: int = 96):
    cache = PrefixCache({HIGH: 1.0, MEDIUM: 0.5, LOW: 0.5})
    policy = create_policy("qos", QoSSettings(kv_caps=dict(CAPS), high_cut_in=False))
    batcher = ContinuousBatcher("sim", [], policy, 8, max_step_tokens, prefix_cache=cache)
    link = CachingWorker(0, num_blocks, batcher.make_pool)
    batcher.workers.add(link)
    batcher.planner.add_worker(link.index)
    return batcher, link


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 60) for _ in range(PREFIX)]
    return [shared + [rng.randrange(3, 60) for _ in range(5)] for _ in range(count)]


async def run(batcher, arrivals, timeout: float = 10.0):
    """`arrivals`: (request, the request it arrives after once that one has computed a step or
    None: at once). Returns the outputs by seq_id."""
    loop = asyncio.create_task(batcher.run())
    try:
        async def arrive(r, after):
            while after is not None and after.computed == 0:
                await asyncio.sleep(0)
            batcher.submit(r)
            tokens, _, last = await drain(r)
            assert getattr(last, "finish_reason", None), f"{r.request_id} failed: {last}"
            return r.seq_id, tokens
        return dict(await asyncio.wait_for(asyncio.gather(*(arrive(r, a) for r, a in arrivals)), timeout))
    finally:
        loop.cancel()


def test_a_burst_sharing_a_prefix_computes_it_once():
    computed = {}
    for sharing in (True, False):
        batcher, link = cluster(max_step_tokens=100)      # room for two whole prompts a step
        if not sharing:
            batcher.prefix_cache.waits = lambda pool, request: False
        burst = [request(i, p, 4) for i, p in enumerate(prompts(6), 1)]
        outputs = asyncio.run(run(batcher, [(r, None) for r in burst]))
        for r in burst:
            assert outputs[r.seq_id] == expected(r.prompt_ids, 4)
        computed[sharing] = sum(len(r.prompt_ids) - r.cached_tokens for r in burst)
        if sharing:
            # The first computes the 10 shared blocks; every other one gets all of them.
            assert sorted(r.cached_tokens for r in burst) == [0] + [PREFIX] * 5
            # The queue's head waits; the others queue behind it (one lane, first come first).
            assert batcher.prefix_cache.waited[MEDIUM] >= 1
    assert computed[True] == PREFIX + 6 * 5
    assert computed[False] >= computed[True] + 2 * PREFIX    # without it, two a step compute it


def test_a_follower_waits_behind_its_own_class_or_a_more_urgent_one_only():
    cases = {(LOW, HIGH): False, (MEDIUM, HIGH): False, (HIGH, HIGH): True, (MEDIUM, MEDIUM): True,
             (HIGH, LOW): True, (MEDIUM, LOW): True}
    for (leader_class, follower_class), waits in cases.items():
        batcher, link = cluster(max_step_tokens=8)
        first, second = prompts(2, seed=5)
        leader = request(1, first, 2, leader_class)
        follower = request(2, second, 2, follower_class)
        outputs = asyncio.run(run(batcher, [(leader, None), (follower, leader)]))
        assert outputs[2] == expected(second, 2)
        # It gets the whole shared prefix from the leader (having waited, or queued behind the
        # leader's prompt anyway), or, High behind a less urgent leader, computes what the leader
        # had not yet computed when it arrived, at once.
        case = (leader_class, follower_class, follower.cached_tokens)
        assert (follower.cached_tokens >= PREFIX - BLOCK) is waits, case
        if not waits:
            assert not batcher.prefix_cache.waited[follower_class], case


def test_a_leader_that_leaves_strands_no_follower():
    """The leader (Medium) is cancelled while Low followers wait (the Low lane gets its turns
    beside it): one of them computes the prefix and the others share it; every output exact,
    nothing led afterwards."""
    batcher, link = cluster(max_step_tokens=16)
    first, *rest = prompts(4, seed=9)
    leader = request(1, first, 50)
    followers = [request(i, p, 3, LOW) for i, p in enumerate(rest, 2)]

    async def until(condition):
        async with asyncio.timeout(10):
            while not condition():
                await asyncio.sleep(0)

    async def scenario():
        loop = asyncio.create_task(batcher.run())
        try:
            batcher.submit(leader)
            await until(lambda: leader.computed > 0)
            for r in followers:
                batcher.submit(r)
            await until(lambda: batcher.prefix_cache.waited[LOW])
            assert leader.computed < PREFIX
            batcher.cancel(leader)
            return await asyncio.wait_for(asyncio.gather(*(drain(r) for r in followers)), 10)
        finally:
            loop.cancel()

    results = asyncio.run(scenario())
    for r, (tokens, _, last) in zip(followers, results):
        assert getattr(last, "finish_reason", None) and tokens == expected(r.prompt_ids, 3)
    assert not batcher.prefix_cache.in_flight.table(link.pool)
    assert max(r.cached_tokens for r in followers) >= PREFIX - BLOCK
