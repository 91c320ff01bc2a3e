"""services/common/prefix_blocks.py: block names, and the prefix-caching pool's invariants under
random interleavings of allocation, naming, sharing and freeing (hypothesis state machine)."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.common.prefix_blocks import PrefixCachingPool, block_hashes

HIGH, MEDIUM, LOW = 0, 1, 2
ORDER = [LOW, MEDIUM, HIGH]          # evicted first to last


def test_names_cover_the_whole_prefix_and_the_adapter():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2                                      # the 8 tokens left over are no block
    assert block_hashes(list(range(33)), 16) == a
    assert block_hashes([0] + list(range(1, 40)), 16) == a  # equal content, equal names
    changed_first = block_hashes([99] + list(range(1, 40)), 16)
    assert changed_first[0] != a[0] and changed_first[1] != a[1]   # a block's name covers its parents
    changed_second = block_hashes(list(range(16)) + [99] + list(range(17, 40)), 16)
    assert changed_second[0] == a[0] and changed_second[1] != a[1]
    assert block_hashes(list(range(40)), 16, adapter="sql#1") != a
    assert block_hashes(list(range(40)), 16, adapter="sql#1") != block_hashes(list(range(40)), 16, adapter="sql#2")


def test_names_extend_incrementally():
    tokens = list(range(100))
    known = block_hashes(tokens[:37], 16)
    assert block_hashes(tokens, 16, known=known) == block_hashes(tokens, 16) and len(known) == 6


def test_a_shared_block_counts_once_per_class_and_once_in_the_pool():
    pool = PrefixCachingPool(8, 4, ORDER)
    [block] = pool.allocate(HIGH, 1)
    assert pool.name(block, b"x" * 16)
    assert pool.lookup([b"x" * 16, b"y" * 16]) == [block]
    pool.share(LOW, [block])
    pool.share(LOW, [block])                  # a second Low sequence on the same block
    assert (pool.held(HIGH), pool.held(LOW), pool.num_used) == (1, 1, 1)
    pool.free(HIGH, [block])
    pool.free(LOW, [block])
    assert pool.held(LOW) == 1 and pool.num_used == 1
    pool.free(LOW, [block])
    assert pool.idle(LOW) == 1 and pool.num_free == 8 and pool.lookup([b"x" * 16]) == [block]


def test_low_idle_blocks_are_evicted_before_high_ones_and_lru_within_a_class():
    pool = PrefixCachingPool(4, 4, ORDER)
    blocks = {}
    for i, owner in enumerate([HIGH, LOW, LOW, HIGH]):
        [block] = pool.allocate(owner, 1)
        pool.name(block, bytes([i]) * 16)
        blocks[i] = block
    for i, owner in enumerate([HIGH, LOW, LOW, HIGH]):
        pool.free(owner, [blocks[i]])
    assert pool.allocate(MEDIUM, 1) == [blocks[1]]        # Low's least recently used
    assert sorted(pool.allocate(MEDIUM, 2)) == sorted([blocks[2], blocks[0]])   # then Low's other, then High's LRU
    assert pool.evictions == Counter({LOW: 2, HIGH: 1})
    assert pool.lookup([bytes([3]) * 16]) == [blocks[3]]


def test_a_class_keeps_at_most_its_idle_limit():
    pool = PrefixCachingPool(8, 4, ORDER, idle_limits={LOW: 1})
    taken = pool.allocate(LOW, 3)
    for i, block in enumerate(taken):
        pool.name(block, bytes([i]) * 16)
    pool.free(LOW, taken)                       # one sequence's blocks, in order: its tail goes first
    assert pool.idle(LOW) == 1 and pool.lookup([bytes([0]) * 16]) == [taken[0]]


def test_undoing_a_share_leaves_idle_blocks_under_their_class():
    pool = PrefixCachingPool(4, 4, ORDER)
    [block] = pool.allocate(HIGH, 1)
    pool.name(block, b"s" * 16)
    pool.free(HIGH, [block])
    woken = pool.share(LOW, [block])           # a Low admission looks it up, then is not admitted
    assert woken == {block: HIGH} and pool.num_free == 3
    pool.free(LOW, [block], woken)
    assert (pool.idle(HIGH), pool.idle(LOW), pool.num_free) == (1, 0, 4)


def test_releasable_counts_only_what_no_one_else_holds():
    pool = PrefixCachingPool(8, 4, ORDER)
    a, b = pool.allocate(LOW, 2)
    pool.name(a, b"a" * 16)
    pool.share(HIGH, [a])                      # a: Low and High; b: Low alone
    assert pool.releasable(LOW, [a, b]) == (1, 2)
    pool.share(LOW, [a])                       # two Low sequences on a
    assert pool.releasable(LOW, [a, b]) == (1, 1)


def test_misuse_raises_before_changing_anything():
    pool = PrefixCachingPool(4, 4, ORDER)
    taken = pool.allocate(HIGH, 2)
    with pytest.raises(ValueError, match="not HIGH|held by"):
        pool.free(LOW, taken)
    with pytest.raises(ValueError, match="not named"):
        pool.share(LOW, taken[:1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(HIGH, [3])
    assert pool.held(HIGH) == 2 and pool.num_free == 2


class PoolMachine(RuleBasedStateMachine):
    """A model of who holds what beside the pool; every invariant of prefix_blocks' docstring."""

    def __init__(self):
        super().__init__()
        self.pool = PrefixCachingPool(12, 4, ORDER, idle_limits={LOW: 3, MEDIUM: 6})
        self.refs: Counter = Counter()         # (owner, block) -> references the model holds
        self.names: dict[int, bytes] = {}      # names of blocks the model holds
        self.next_name = 0

    def held_by_model(self) -> set[int]:
        return {block for (_, block), n in self.refs.items() if n}

    @rule(owner=st.sampled_from(ORDER), count=st.integers(0, 5))
    def allocate(self, owner, count):
        idle_before = {o: list(self.pool._idle[o]) for o in ORDER}
        taken = self.pool.allocate(owner, count)
        if taken is None:
            assert count > self.pool.num_free
            return
        assert not set(taken) & self.held_by_model(), "a held block was given out again"
        # Eviction took idle blocks lowest class first, least recently used first.
        evicted = [b for o in ORDER for b in idle_before[o] if b in taken]
        expected = [b for o in ORDER for b in idle_before[o]][:len(evicted)]
        assert evicted == expected
        for block in taken:
            self.refs[(owner, block)] += 1
            self.names.pop(block, None)

    @precondition(lambda self: self.held_by_model())
    @rule(data=st.data())
    def name_a_block(self, data):
        block = data.draw(st.sampled_from(sorted(self.held_by_model())))
        name = self.next_name.to_bytes(16, "little")
        self.next_name += 1
        if self.pool.name(block, name):
            self.names[block] = name
        else:
            assert block in self.names

    @precondition(lambda self: self.pool.num_named)
    @rule(owner=st.sampled_from(ORDER), data=st.data())
    def share_a_named_prefix(self, owner, data):
        names = sorted(self.pool._block_of)
        chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
        found = self.pool.lookup(chosen)
        assert found == [self.pool._block_of[n] for n in chosen[:len(found)]]
        self.pool.share(owner, found)
        for block in found:
            self.refs[(owner, block)] += 1
            self.names[block] = self.pool._name_of[block]

    @precondition(lambda self: self.pool.num_named)
    @rule(owner=st.sampled_from(ORDER), data=st.data())
    def share_then_undo(self, owner, data):
        name = data.draw(st.sampled_from(sorted(self.pool._block_of)))
        found = self.pool.lookup([name])
        idle_under = {b: self.pool._idle_owner.get(b) for b in found}
        woken = self.pool.share(owner, found)
        self.pool.free(owner, found, woken)
        for block in found:
            assert self.pool._idle_owner.get(block) == idle_under[block]

    @precondition(lambda self: self.held_by_model())
    @rule(data=st.data())
    def free_some(self, data):
        held = sorted(key for key, n in self.refs.items() if n)
        owner, _ = data.draw(st.sampled_from(held))
        mine = [block for (o, block), n in self.refs.items() if o == owner and n]
        blocks = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True))
        self.pool.free(owner, blocks)
        for block in blocks:
            self.refs[(owner, block)] -= 1

    @invariant()
    def held_blocks_are_never_evicted_or_renamed(self):
        for block in self.held_by_model():
            assert block in self.pool._holders
            if block in self.names:
                assert self.pool._name_of.get(block) == self.names[block]
                assert self.pool._block_of[self.names[block]] == block

    @invariant()
    def counts_agree_with_the_model(self):
        for (owner, block), n in self.refs.items():
            assert n >= 0
            assert self.pool._holders.get(block, Counter())[owner] == n
        for owner in ORDER:
            assert self.pool.held(owner) == len({b for (o, b), n in self.refs.items() if o == owner and n})
        assert all(n > 0 for holders in self.pool._holders.values() for n in holders.values())

    @invariant()
    def every_block_is_free_idle_or_held_once(self):
        idle = [b for o in ORDER for b in self.pool._idle[o]]
        everything = self.pool._free + idle + list(self.pool._holders)
        assert sorted(everything) == list(range(12))
        assert self.pool.num_free == len(self.pool._free) + len(idle)
        assert set(self.pool._name_of) == set(self.pool._block_of.values())
        assert set(self.pool._name_of) <= set(idle) | set(self.pool._holders)
        assert self.pool.idle(LOW) <= 3 and self.pool.idle(MEDIUM) <= 6

    def teardown(self):
        for (owner, block), n in list(self.refs.items()):
            for _ in range(n):
                self.pool.free(owner, [block])
        # Only idle named blocks are left, and all of them can be reclaimed.
        assert not self.pool._holders and self.pool.num_free == 12
        assert sorted(self.pool.allocate(HIGH, 12)) == list(range(12))


TestPrefixCachingPool = PoolMachine.TestCase
TestPrefixCachingPool.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
