"""KV block accounting for one pool: which block ids are free and who holds the rest.

Pure Python, no torch: the scheduler owns allocation so per-class quotas are exact; workers only
index their KV tensors with the block tables they are sent. Lives in common/ because the engine's
offline driver (services/engine/batch_runner.py) allocates from the same pool.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from itertools import repeat


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` positions."""
    return -(-num_tokens // block_size)


def take_from_end(free: list[int], count: int) -> list[int]:
    """Pop `count` (> 0) block ids off the end of a free list, in the order popped: recently
    freed blocks are reused first."""
    taken = free[:-count - 1:-1]
    del free[-count:]
    return taken


def cap_blocks(num_blocks: int, share: float) -> int:
    """The most blocks a class may hold when its cap is `share` of `num_blocks` (rounded down,
    so a cap is never exceeded; the epsilon keeps 0.3 * 10 from flooring to 2)."""
    return int(share * num_blocks + 1e-9)


class KVBlockPool:
    """A free list of block ids plus, for every allocated block, the owner it was given to.

    An owner is any hashable key the caller accounts by (a priority class, a tenant); counts per
    owner are kept incrementally so quota checks are O(1).
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popped from the end: recently freed blocks are reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owner_of: dict[int, Hashable] = {}
        self._held: Counter = Counter()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def held(self, owner: Hashable) -> int:
        return self._held[owner]

    def holdings(self) -> dict[Hashable, int]:
        return {owner: n for owner, n in self._held.items() if n}

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, owner: Hashable, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` free blocks for `owner`; None (and nothing taken) if too few are free."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free):
            return None
        if not num_blocks:
            return []
        taken = take_from_end(self._free, num_blocks)
        self._owner_of.update(zip(taken, repeat(owner)))
        self._held[owner] += num_blocks
        return taken

    def free(self, owner: Hashable, blocks: Iterable[int]) -> None:
        """Return `owner`'s blocks to the free list. Freeing a block one does not hold is a bug in
        the caller and raises, before anything is changed."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block ids freed twice in one call: {blocks}")
        for block in blocks:
            holder = self._owner_of.get(block)
            if holder is None:
                raise ValueError(f"block {block} is not allocated")
            if holder != owner:
                raise ValueError(f"block {block} is held by {holder!r}, not {owner!r}")
        # Back in reverse, so that the next allocation pops them in the order they were held: a
        # sequence's blocks then lie in ascending addresses where they were side by side, which
        # the CPU's prefetchers stream (the paged attention kernel's decodes took 1.3-1.6x as long
        # over the same keys with each sequence's blocks in descending order: bench/attention_rows.py).
        for block in reversed(blocks):
            del self._owner_of[block]
            self._free.append(block)
        self._held[owner] -= len(blocks)

    def owners(self) -> dict[int, dict[Hashable, int]]:
        """Every held block -> {owner: references} (here always one): a debug view, for checks
        that each block is held by exactly the sequences that list it (tests/sim)."""
        return {block: {owner: 1} for block, owner in self._owner_of.items()}

    def releasable(self, owner: Hashable, blocks: list[int]) -> tuple[int, int]:
        """What freeing `blocks` would give back: to the pool, and off `owner`'s count (all of
        them: nothing is shared here; services/common/prefix_blocks.py shares)."""
        return len(blocks), len(blocks)
