"""The second KV tier, scheduler side (services/scheduler/kv_tier.py, prefix_cache.py): simulated
caching workers whose tier holds the (position, token) contents of each saved block and copies
as the plans say, in order. A load of the wrong slot, a save after the block was overwritten, or
a slot written before its load was done, reads back positions that do not hold what they should,
and the outputs (a function of what the block tables read back) come out different. Pure Python."""
from __future__ import annotations

import asyncio
import random
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.kv_blocks import blocks_for_tokens
from services.common.priority import HIGH, LOW, MEDIUM, ORDER
from services.scheduler.kv_tier import KVTierMirror
from services.scheduler.prefix_cache import PrefixCache
from tests.unit.test_prefix_scheduling import (BLOCK, CAPS, CachingWorker, conversations, expected, ideal_cached,
                                               request)
from tests.unit.test_prefix_scheduling import serve as prefix_serve


class TierWorker(CachingWorker):
    """A caching worker with a second tier of `tier_blocks` slots, copied as WorkerLink sends it."""

    def __init__(self, index: int, num_blocks: int, make_pool, tier_blocks: int):
        self.tier_blocks = tier_blocks
        super().__init__(index, num_blocks, make_pool)

    def restart(self) -> None:
        super().restart()
        self.pool = self.make_pool(self.info.num_blocks, BLOCK, self.tier_blocks, 1.0)
        self.tier_slots: dict[int, list] = {}
        self.copies = Counter()

    async def execute(self, plan, sent=None):
        tier = self.pool.tier if self.pool is not None else None
        if tier is not None:
            blocks, slots, loads = tier.take_copies()
            for block, slot, load in zip(blocks, slots, loads):
                if load:
                    for offset, entry in enumerate(self.tier_slots[slot]):
                        self.kv[block * BLOCK + offset] = entry
                else:
                    self.tier_slots[slot] = [self.kv.get(block * BLOCK + o) for o in range(BLOCK)]
                self.copies["load" if load else "save"] += 1
        return await super().execute(plan, sent)


def serve(batches, num_blocks: int, tier_blocks: int, workers: int = 1):
    """test_prefix_scheduling's serve() with caching on, on workers with tiers of `tier_blocks`."""
    return prefix_serve(batches, True, num_blocks=num_blocks, workers=workers,
                        make_worker=lambda i, n, make_pool: TierWorker(i, n, make_pool, tier_blocks))


def test_conversations_whose_blocks_the_pool_evicted_load_them_back_exact():
    system = [random.Random(7).randrange(3, 60) for _ in range(10)]
    hits = {}
    for tier_blocks in (0, 8 * 64):
        batches = conversations(random.Random(1), users=8, turns=4, system=system)
        ideal = sum(ideal_cached(batches).values())
        outputs, batcher, links = asyncio.run(serve(batches, num_blocks=64, tier_blocks=tier_blocks))
        for batch in batches:
            for r in batch:
                assert outputs[r.seq_id] == expected(r.prompt_ids, 6)
        cache = batcher.prefix_cache
        hits[tier_blocks] = sum(cache.hits.values())
        if tier_blocks:
            assert links[0].copies["load"] == sum(cache.tier_loaded.values()) > 0
            assert links[0].copies["save"] == sum(cache.tier_saved.values()) > 0
            assert sum(cache.tier_hits.values()) > 0
    # The pool alone keeps a part of what earlier turns computed; with the tier, all of it (and
    # more, where a request of the same turn computed a shared block first).
    assert hits[0] < ideal <= hits[8 * 64]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(14, 30), tier_blocks=st.integers(1, 40),
       workers=st.integers(1, 2))
def test_random_prefixes_under_memory_pressure_with_a_small_tier(seed, num_blocks, tier_blocks, workers):
    """Preemption, pool eviction and tier drops all happen; blocks are saved and loaded within
    the same plans as they are given out again. Outputs stay exact and caps hold."""
    rng = random.Random(seed)
    shared = [[rng.randrange(3, 60) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    batches = []
    seq_id = 0
    for _ in range(3):
        batch = []
        for _ in range(8):
            seq_id += 1
            prompt = rng.choice(shared) + [rng.randrange(3, 60) for _ in range(rng.randint(1, 8))]
            priority, max_tokens = rng.choice(ORDER), rng.randint(1, 8)
            if blocks_for_tokens(len(prompt) + max_tokens + 1, BLOCK) > int(CAPS[priority] * num_blocks):
                priority = HIGH
            batch.append(request(seq_id, prompt, max_tokens, priority))
        batches.append(batch)
    outputs, batcher, links = asyncio.run(serve(batches, num_blocks, tier_blocks, workers=workers))
    for batch in batches:
        for r in batch:
            assert outputs[r.seq_id] == expected(r.prompt_ids, r.sampling.max_tokens)
    for priority, cap in CAPS.items():
        assert batcher.kv_peak[priority] <= int(cap * num_blocks + 1e-9)
    for link in links:
        assert link.pool.holdings() == {} and len(link.pool.tier) <= tier_blocks


def test_a_block_computed_under_other_weights_is_never_loaded():
    """An adapter loaded again under its name (new weights) names new blocks: what the tier holds
    from before is not found for the same prompt. Before the reload it is."""
    cache = PrefixCache({HIGH: 1.0, MEDIUM: 1.0, LOW: 1.0})
    pool = cache.make_pool(8, BLOCK, tier_blocks=16)
    prompt = list(range(3, 3 + 4 * BLOCK + 1))

    def computed_then_evicted():
        first = request(1, prompt, 1)
        first.lora = "a"
        blocks = pool.allocate(MEDIUM, 4)
        for block, name in zip(blocks, cache.names(first, 4, BLOCK)):
            pool.name(block, name)
        pool.free(MEDIUM, blocks)
        pool.allocate(MEDIUM, 8)                         # evicts all four into the tier
        pool.free(MEDIUM, list(range(8)))
        return first

    def loads_for_the_same_prompt() -> int:
        again = request(2, prompt, 1)
        again.lora = "a"
        cached, woken = cache.take_cached(pool, again)
        assert cached == []
        loaded = cache._load_from_tier(pool, again, cached, first=True)
        if loaded:
            pool.free(MEDIUM, loaded)
        return len(loaded)

    computed_then_evicted()
    assert len(pool.tier) == 4
    assert loads_for_the_same_prompt() == 4              # the same weights: loaded back
    computed_then_evicted()
    cache.adapter_loaded("a")                            # new weights under the same name
    assert len(pool.tier) >= 4
    assert loads_for_the_same_prompt() == 0
    scoped = request(3, prompt, 1)
    scoped.lora, scoped.cache_scope = "a", "tenant-b"    # another scope names other blocks too
    assert cache._load_from_tier(pool, scoped, [], first=True) == []


def test_retention_lets_low_go_first_and_bounds_each_class():
    tier = KVTierMirror(4, BLOCK, [LOW, MEDIUM, HIGH], {HIGH: 4, MEDIUM: 2, LOW: 1})
    tier.save(0, b"h1", HIGH)
    tier.save(1, b"l1", LOW)
    tier.save(2, b"l2", LOW)                # Low keeps at most one: l1 goes
    assert b"l1" not in tier and b"l2" in tier and tier.dropped[LOW] == 1
    tier.save(3, b"m1", MEDIUM)
    tier.save(4, b"h2", HIGH)               # full now: h1 h2 m1 l2
    tier.save(5, b"h3", HIGH)               # Low's goes first
    assert b"l2" not in tier and {tier.held(p) for p in ORDER} == {3, 1, 0}
    # Slots freed by a drop are used again: the copies say which block went to which slot.
    assert tier.take_copies() == ([0, 1, 2, 3, 4, 5], [0, 1, 2, 1, 3, 2], [False] * 6)
    assert tier.take_copies() == ([], [], [])


def test_loading_stops_where_computing_is_cheaper():
    tier = KVTierMirror(4, BLOCK, ORDER, load_us_per_block=400.0)
    assert tier.worth_loading                       # no step seen yet
    tier.note_step(64, 64 * 0.2)                    # 200 us a token: a block computes in 800 us
    assert tier.worth_loading
    for _ in range(50):
        tier.note_step(64, 64 * 0.01)               # 10 us a token: 40 us a block, under the copy's 400
    assert not tier.worth_loading
    tier.note_step(1, 5.0)                          # a one-token step tells nothing about prefill
    assert not tier.worth_loading
