"""The KV block pool: exact per-owner accounting, all-or-nothing allocation, safe frees."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from services.common.kv_blocks import KVBlockPool, blocks_for_tokens
from services.common.prefix_blocks import PrefixCachingPool

@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (16, 1), (17, 2), (4000, 250)])
def test_blocks_for_tokens(tokens, blocks):
    assert blocks_for_tokens(tokens, 16) == blocks


def test_allocate_and_free_track_owners():
    pool = KVBlockPool(num_blocks=10, block_size=16)
    low = pool.allocate("low", 3)
    high = pool.allocate("high", 5)
    assert len(set(low) | set(high)) == 8
    assert (pool.held("low"), pool.held("high"), pool.num_free, pool.num_used) == (3, 5, 2, 8)
    assert pool.allocate("medium", 3) is None            # all or nothing
    assert pool.num_free == 2 and pool.held("medium") == 0
    pool.free("low", low)
    assert pool.holdings() == {"high": 5}
    assert pool.can_allocate(5) and not pool.can_allocate(6)


@pytest.mark.parametrize("pool_of", [lambda: KVBlockPool(12, 16), lambda: PrefixCachingPool(12, 16, ["low"])],
                         ids=["plain", "prefix-caching"])
def test_a_freed_sequences_blocks_come_back_in_their_order(pool_of):
    """A sequence's blocks, freed and handed to the next sequence, come back in the order they
    were held (ascending where a fresh pool gave them so), not reversed: the attention kernel
    streams a sequence's blocks fastest in ascending addresses. The prefix-caching pool alike."""
    pool = pool_of()
    first = pool.allocate("low", 5)
    assert first == sorted(first)
    pool.free("low", first)
    assert pool.allocate("low", 5) == first
    assert pool.allocate("low", 3) == [5, 6, 7]             # fresh ones after them, ascending too


def test_bad_frees_raise_and_change_nothing():
    pool = KVBlockPool(num_blocks=4, block_size=16)
    a = pool.allocate("a", 2)
    b = pool.allocate("b", 1)
    with pytest.raises(ValueError, match="held by 'b', not 'a'"):
        pool.free("a", [a[0], b[0]])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free("a", [a[0], 3 if 3 not in a + b else 0])
    with pytest.raises(ValueError, match="twice"):
        pool.free("a", [a[0], a[0]])
    assert (pool.held("a"), pool.held("b"), pool.num_free) == (2, 1, 1)
    pool.free("a", a)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free("a", a)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["high", "medium", "low"]), st.integers(0, 6),
                          st.booleans()), max_size=60))
def test_invariants_under_random_use(ops):
    pool = KVBlockPool(num_blocks=20, block_size=16)
    held: dict[str, list[list[int]]] = {"high": [], "medium": [], "low": []}
    for owner, n, release in ops:
        if release and held[owner]:
            pool.free(owner, held[owner].pop(0))
        else:
            got = pool.allocate(owner, n)
            expect_ok = n <= 20 - sum(len(b) for blocks in held.values() for b in blocks)
            assert (got is not None) == expect_ok
            if got is not None:
                held[owner].append(got)
        all_blocks = [b for blocks in held.values() for chunk in blocks for b in chunk]
        assert len(all_blocks) == len(set(all_blocks))           # no block given out twice
        assert all(0 <= b < 20 for b in all_blocks)
        assert pool.num_free == 20 - len(all_blocks)
        for name, blocks in held.items():
            assert pool.held(name) == sum(len(c) for c in blocks)
