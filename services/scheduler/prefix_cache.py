"""The scheduler's side of prefix caching; the blocks' bookkeeping is services/common/prefix_blocks.py.

- Admission to a worker (planner._admit): the longest run of the request's leading full blocks
  that the worker's pool has named is shared; they become its first blocks and the worker starts
  computing at the first token after them (NewSequence.cached_tokens). At least one token is
  always computed, for the logits of the last: only blocks wholly before the last known token are
  taken. A resumed (preempted) sequence finds its own blocks this way, if they were not evicted.
- After each step (batcher.postprocess): the blocks a sequence filled with computed K/V are named,
  so that later sequences, and this one after a preemption, can share them.
- Placement (placement(), asked through placer()): a request goes to the worker of the pool
  holding the longest cached prefix of it, unless that worker runs more sequences than the least
  loaded one by more than `affinity_margin` of max_running (then load wins: any worker may take
  it, the emptiest first), or has no running slot free.
- Per class: prompt tokens looked up and found at first admission (the hit rate), and the pools'
  evictions, for /metrics, `qos-serve stats` and the console.

A block's name includes the request's cache scope (its tenant and cache_salt, as the router set
them; services/router/cache_affinity.py): requests of different scopes never share a block, so
none learns from a hit what another scope sent. It also includes the adapter and its load
generation: a LoRA adapter loaded again under the same name (new weights) names new blocks
(adapter_loaded). Pure Python, no torch.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from services.common.kv_blocks import blocks_for_tokens, cap_blocks
from services.common.prefix_blocks import PrefixCachingPool, block_name
from services.common.priority import ORDER
from services.scheduler.kv_tier import KVTierMirror
from services.scheduler.prefix_in_flight import InFlightPrefixes
from services.scheduler.request import Request


class PrefixCache:
    def __init__(self, idle_shares: dict[int, float], affinity_margin: float = 0.25):
        self.idle_shares = idle_shares        # per class: the most of a pool its idle blocks keep
        self.affinity_margin = affinity_margin
        self.queried: Counter = Counter()     # per class: prompt tokens at first admission
        self.hits: Counter = Counter()        # per class: of those, computed from cache
        self.adapter_generation: Counter = Counter()
        self.in_flight = InFlightPrefixes()   # blocks being computed: who else waits for them
        self.waited: Counter = Counter()      # per class: requests that waited for a leader's blocks
        # Second KV tiers (kv_tier.py), over every worker: blocks saved, loaded back, dropped, per
        # class; prompt tokens loaded instead of computed (part of `hits`).
        self.tier_saved, self.tier_loaded, self.tier_dropped = Counter(), Counter(), Counter()
        self.tier_hits: Counter = Counter()

    def make_pool(self, num_blocks: int, block_size: int, tier_blocks: int = 0,
                  load_us_per_block: float = 0.0) -> PrefixCachingPool:
        """A worker's pool: idle blocks evicted lowest class first, each class's bounded; with
        `tier_blocks`, the mirror of its second tier, where evicted blocks go (kv_tier.py)."""
        order = sorted(ORDER, reverse=True)
        pool = PrefixCachingPool(num_blocks, block_size, eviction_order=order,
                                 idle_limits={priority: cap_blocks(num_blocks, share)
                                              for priority, share in self.idle_shares.items()})
        if tier_blocks:
            pool.tier = KVTierMirror(tier_blocks, block_size, order, {
                priority: cap_blocks(tier_blocks, share) for priority, share in self.idle_shares.items()},
                load_us_per_block, (self.tier_saved, self.tier_loaded, self.tier_dropped))
            pool.on_evict = pool.tier.save
        return pool

    def adapter_loaded(self, name: str) -> None:
        """`name` was (re)loaded on a worker: its blocks from before are no longer its K/V."""
        self.adapter_generation[name] += 1

    def names(self, request: Request, count: int, block_size: int) -> list[bytes]:
        """The names of the request's first `count` full blocks (computed once, kept on it)."""
        adapter = f"{request.lora}#{self.adapter_generation[request.lora]}" if request.lora else ""
        key = f"{request.cache_scope}\x00{adapter}" if request.cache_scope else adapter
        if key != request.names_key:
            request.block_names, request.names_key = [], key
        names = request.block_names
        while len(names) < count:
            start = len(names) * block_size
            names.append(block_name(names[-1] if names else None, request.token_ids(start, start + block_size), key))
        return names

    def _usable_names(self, pool: PrefixCachingPool, request: Request) -> list[bytes]:
        """The names of the request's blocks wholly before its last known token (that one is
        always computed, for its logits): those a cache may give it. None while it collects its
        prompt's logprobs: every prompt token's row is computed for them."""
        if request.prompt_logprobs is not None:
            return []
        usable = (request.num_tokens - 1) // pool.block_size
        return self.names(request, usable, pool.block_size)[:usable] if usable > 0 else []

    def _cached_prefix(self, pool: PrefixCachingPool, request: Request) -> list[int]:
        """The pool's blocks holding the request's longest cached prefix of its usable blocks."""
        return pool.lookup(self._usable_names(pool, request))

    def take_cached(self, pool: PrefixCachingPool, request: Request) -> tuple[list[int], dict]:
        """The request's cached prefix on the pool, now referenced for its class, and the blocks
        that were idle (pass both to pool.free to undo it, if it is not admitted after all)."""
        blocks = self._cached_prefix(pool, request)
        return blocks, (pool.share(request.priority, blocks) if blocks else {})

    def cached_blocks(self, pool: PrefixCachingPool, request: Request) -> int:
        """How many of the request's leading blocks the pool would give it now (take_cached,
        without taking them), or once the sequences running there have computed them."""
        names = self._usable_names(pool, request)
        found = len(pool.lookup(names))
        return found + self.in_flight.run(pool, names[found:])

    def admitted(self, pool: PrefixCachingPool, request: Request, cached: list[int], first: bool) -> None:
        """Admitted to `pool` with `cached` blocks (room made for all it holds, cached ones
        aside); `first`: its first admission (counted for the hit rate and reported in its
        usage). What follows them in the pool's second tier is loaded back; the cached blocks
        become its first; it leads the full blocks it is about to compute."""
        block_size = pool.block_size
        if pool.tier is not None:
            cached = self._load_from_tier(pool, request, cached, first)
        if cached:
            request.start_cached(cached, block_size)
        full = request.num_tokens // block_size
        if full > len(cached):
            self.in_flight.lead(pool, request, self.names(request, full, block_size)[len(cached):full])
        if first:
            prompt = len(request.prompt_ids)
            request.cached_tokens = min(len(cached) * block_size, prompt)
            self.queried[request.priority] += prompt
            self.hits[request.priority] += request.cached_tokens
        request.next_name_at = (len(cached) + 1) * block_size

    def _load_from_tier(self, pool: PrefixCachingPool, request: Request, cached: list[int], first: bool) -> list[int]:
        """`cached` and the blocks that continue the request's prefix after them: from the tier,
        fresh pool blocks its copies are loaded into (when loading costs less than computing),
        or blocks the pool still holds further on (the tail of a prefix outlives its head when
        the head was evicted first)."""
        tier, block_size, found = pool.tier, pool.block_size, len(cached)
        names = self._usable_names(pool, request)[found:]
        if not names or not tier.worth_loading:
            return cached
        blocks, loads = list(cached), []
        for name in names:
            held = pool.lookup((name,))
            if held:
                pool.share(request.priority, held)
            elif name not in tier:
                break
            else:
                loads.append(len(blocks))
            blocks.append(held[0] if held else -1)
        if not loads:
            return cached
        slots = tier.take([names[index - found] for index in loads])
        fresh = pool.allocate(request.priority, len(loads))
        tier.loaded_into(slots, fresh, request.priority)
        for index, block in zip(loads, fresh):
            blocks[index] = block
            pool.name(block, names[index - found])
        if first:
            self.tier_hits[request.priority] += len(loads) * block_size
        return blocks

    def name_computed(self, pool: PrefixCachingPool, request: Request) -> None:
        """After a step that took the request past `next_name_at`: name the blocks it filled."""
        block_size = pool.block_size
        full = request.computed // block_size
        names = self.names(request, full, block_size)
        blocks = request.blocks
        for index in range(request.next_name_at // block_size - 1, full):
            pool.name(blocks[index], names[index])
        request.next_name_at = (full + 1) * block_size
        self.in_flight.named(pool, request, full)

    def released(self, pool: PrefixCachingPool, request: Request) -> None:
        """The request left `pool`: blocks it was computing are no longer awaited."""
        self.in_flight.gone(pool, request)

    def waits(self, pool: PrefixCachingPool, request: Request) -> bool:
        """Should the request stay queued this step, for the block after its cached prefix on
        `pool`, which a running leader of its class or a more urgent one is computing
        (prefix_in_flight.py)? Counted once per request, per class."""
        if request.window is not None:
            return False
        names = self._usable_names(pool, request)
        found = len(pool.lookup(names))
        if found >= len(names) or self.in_flight.leader(pool, request, names[found]) is None:
            return False
        if not request.waited_for_prefix:
            request.waited_for_prefix = True
            self.waited[request.priority] += 1
        return True

    def placer(self, workers, planner, step: Callable[[], int]) -> Callable[[object, Request], bool]:
        """The planner's may_place(worker, request) for a pool's WorkerSet: may that worker admit
        the request now? Where: decided by placement() once per request and step (`step()`);
        when: not while a sequence running there computes its next block (waits())."""
        def may_place(worker, request: Request) -> bool:
            placed = request.placement
            if placed is None or placed[0] != step():
                # Only workers whose class cap holds its whole sequence: pinned to a smaller one
                # (its prefix cached there), it would wait there for good.
                whole = len(request.prompt_ids) + request.sampling.max_tokens
                open_workers = [w for w in workers if w.is_connected and w.pool is not None and workers.admits(w)
                                and blocks_for_tokens(whole, w.pool.block_size)
                                <= planner.room.class_cap(w.pool, request.priority)]
                placed = request.placement = (step(), self.placement(request, open_workers, planner.running,
                                                                     planner.max_running))
            return (placed[1] is None or placed[1] == worker.index) and not self.waits(worker.pool, request)
        return may_place

    def placement(self, request: Request, workers: list, running: dict[int, list], max_running: int) -> int | None:
        """The index of the worker among `workers` (those taking new sequences) that should admit
        the request, or None for any: nothing cached anywhere, every worker holds as much, or
        load wins (the best one's running sequences exceed the least loaded one's by more than
        the margin, or it has no slot free)."""
        if len(workers) < 2 or request.window is not None:   # streaming mode shares no cache
            return None
        loads = {w.index: len(running.get(w.index, ())) / max_running for w in workers}
        cached = {w.index: self.cached_blocks(w.pool, request) for w in workers}
        best = max(workers, key=lambda w: (cached[w.index], -loads[w.index])).index
        if cached[best] == min(cached.values()) or loads[best] >= 1.0 \
                or loads[best] - min(loads.values()) > self.affinity_margin:
            return None
        return best

    @staticmethod
    def work_lost(request: Request, block_size: int) -> int:
        """Tokens a preempted sequence computes again if its named blocks stay cached: those past
        its last named block (VictimOrder's key when caching is on); all of a streaming one's."""
        if request.window is not None:
            return request.computed
        return request.computed - min(request.computed, (request.next_name_at // block_size - 1) * block_size)
