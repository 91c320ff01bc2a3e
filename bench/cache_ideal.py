"""What a prefix cache could have served of a sequence of prompts, for bench/trace_replay.py: an LRU
cache of a given number of blocks (the bounded ideal: a pool's KV capacity) or of any number (the
unbounded ideal), and a cache of the same size that knows the future (the bounded optimum). Pure.

The rules are the server's (services/scheduler/prefix_cache.py, services/common/prefix_blocks.py):
a block is a full `block_size` run of tokens named by it and everything before it; a prompt is
served the longest run of its first blocks the cache holds, within the blocks before its last
token (one token is always computed); afterwards every full block of the prompt is kept. The
ideal cache differs from the server's in what it ignores: requests are taken one at a time in
arrival order (one that arrives while another is still computing a shared prefix is served it
anyway), running requests take no room, outputs are not kept (a replayed trace's outputs are
never in a later prompt), and there is one cache, not one per worker.

Eviction takes the least recently used block. A request's blocks are touched last block first,
so its first blocks are the most recent: the tail of a prefix goes before its head, and a block
is never kept while the block before it is gone (it could serve no one). LRU is a reference, not
a bound: a server that keeps some blocks longer than others (the pool's per-class idle limits,
which a long one-off prompt cannot flush past) may beat it. The bounded optimum evicts the block
whose next use is furthest away (Belady's MIN; deepest first among equals, so that no block
outlives the one before it): no eviction rule serves more at that size, up to the prefix
constraint, so it is the bound to compare with.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from services.common.prefix_blocks import block_hashes


def prompt_blocks(token_ids: Sequence[int], block_size: int) -> tuple[list[bytes], int]:
    """The names of a prompt's full blocks (the server's), and how many of them it could be served."""
    return block_hashes(token_ids, block_size), max(0, (len(token_ids) - 1) // block_size)


def lru_hits(requests: Sequence[tuple[Sequence[Hashable], int]], capacity: int | None) -> list[int]:
    """For each request in order, given as (its full blocks' names, how many it could be served),
    the blocks an LRU cache of `capacity` blocks (None: unbounded) served it."""
    cache: OrderedDict[Hashable, None] = OrderedDict()
    served = []
    for names, usable in requests:
        n = 0
        while n < usable and names[n] in cache:
            n += 1
        served.append(n)
        for name in reversed(names):
            cache[name] = None
            cache.move_to_end(name)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return served


def optimal_hits(requests: Sequence[tuple[Sequence[Hashable], int]], capacity: int) -> list[int]:
    """As lru_hits, for a cache that evicts the block next used furthest ahead (never: first)."""
    next_use: list[list[float]] = [[] for _ in requests]
    seen: dict[Hashable, float] = {}
    for i in range(len(requests) - 1, -1, -1):
        names, usable = requests[i]
        next_use[i] = [seen.get(name, math.inf) for name in names]
        for name in names[:usable]:
            seen[name] = i
    cache: dict[Hashable, float] = {}
    heap: list[tuple[float, int, int, Hashable]] = []     # (-next use, -depth, tie, name)
    served, tie = [], 0
    for i, (names, usable) in enumerate(requests):
        n = 0
        while n < usable and names[n] in cache:
            n += 1
        served.append(n)
        for depth, name in enumerate(names):
            cache[name] = next_use[i][depth]
            tie += 1
            heapq.heappush(heap, (-next_use[i][depth], -depth, tie, name))
        while len(cache) > capacity:
            use, _, _, name = heapq.heappop(heap)
            if cache.get(name) == -use:         # else a stale entry: the block was used again since
                del cache[name]
    return served


def ideal_share(prompts: Sequence[Sequence[int]], block_size: int, capacity_blocks: int | None,
                optimal: bool = False) -> float:
    """Cached tokens over prompt tokens an LRU cache of `capacity_blocks` (None: unbounded) would
    have served these prompts, in order; with `optimal`, the cache that knows the future."""
    blocks = [prompt_blocks(p, block_size) for p in prompts]
    served = (optimal_hits(blocks, capacity_blocks) if optimal and capacity_blocks is not None
              else lru_hits(blocks, capacity_blocks))
    total = sum(len(p) for p in prompts)
    return sum(served) * block_size / total if total else float("nan")
