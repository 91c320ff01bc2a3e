"""Prefix caching over one worker's KV blocks: a full block is named by what it holds, kept after
its last sequence ends, and given to a later sequence that starts with the same tokens, which
then skips computing them.

A block's name (block_hashes) covers its parent block's name, its token ids and the LoRA adapter
(with the adapter's load generation, so reloading a name under new weights names new blocks):
two blocks with one name hold the same K/V, since a position's K/V depend only on the tokens up
to it. The name is a 128-bit blake2b digest: unlike Python's hash(), the same in every process
and never equal for two different contents in practice.

PrefixCachingPool keeps KVBlockPool's interface (the planner allocates and frees through it) and
adds sharing:
- A block's holders are counted per owner (a priority class). `held(owner)` is the number of
  distinct blocks that owner's sequences reference: a block shared by a High and a Low sequence
  counts against both classes' caps, once each, and once against the pool. A class's cap then
  bounds what its sequences would need without the other class, so sharing can never carry a
  class past its cap, and no class's admission depends on another class keeping its blocks.
- A named block whose last holder lets go stays, idle, in the LRU of the class that held it last.
  Idle blocks count as free (`num_free`) and are reclaimed when fresh blocks run short: Low's
  least recently used first, then Medium's, then High's (`eviction_order`); each class's idle
  blocks are also bounded (`idle_limits`), the oldest going first past it.
- Unnamed blocks (partial, or whose content another block already names) go back to the free
  list when their holder lets go.
Pure Python, no torch.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from hashlib import blake2b

from services.common.kv_blocks import take_from_end

DIGEST_BYTES = 16


def block_name(parent: bytes | None, token_ids: Sequence[int], adapter: str = "") -> bytes:
    """The name of a full block holding `token_ids` after the block named `parent` (None: the
    first block, whose parent is the adapter key)."""
    digest = blake2b(adapter.encode() if parent is None else parent, digest_size=DIGEST_BYTES)
    digest.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    return digest.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, adapter: str = "",
                 known: list[bytes] | None = None) -> list[bytes]:
    """The names of every full block of `token_ids` (as many as fit whole), extending `known`
    (the names of its first blocks, computed before) in place and returning it."""
    hashes = [] if known is None else known
    for index in range(len(hashes), len(token_ids) // block_size):
        hashes.append(block_name(hashes[-1] if hashes else None,
                                 token_ids[index * block_size:(index + 1) * block_size], adapter))
    return hashes


class PrefixCachingPool:
    """One worker's KV blocks: free, held (by one or more owners), or named and idle."""

    def __init__(self, num_blocks: int, block_size: int, eviction_order: Sequence[Hashable],
                 idle_limits: dict[Hashable, int] | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.eviction_order = list(eviction_order)
        self.idle_limits = dict(idle_limits or {})
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))   # popped from the end
        self._holders: dict[int, Counter] = {}        # held block -> owner -> references
        self._held: Counter = Counter()               # owner -> distinct blocks referenced
        self._block_of: dict[bytes, int] = {}         # name -> block
        self._name_of: dict[int, bytes] = {}          # block -> name
        self._idle: dict[Hashable, OrderedDict] = {owner: OrderedDict() for owner in self.eviction_order}
        self._idle_owner: dict[int, Hashable] = {}     # idle block -> the owner that held it last
        self._idle_count = 0
        self.evictions: Counter = Counter()           # per owner of the idle block evicted
        # Told (block, name, owner) as an idle named block is reclaimed, before it is given out
        # again: a second KV tier keeps it (services/scheduler/kv_tier.py, the mirror in `tier`).
        self.on_evict: Callable[[int, bytes, Hashable], None] | None = None
        self.tier = None

    # --- KVBlockPool's interface -----------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be given out now: free ones and idle named ones (reclaimed on demand)."""
        return len(self._free) + self._idle_count

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def held(self, owner: Hashable) -> int:
        return self._held[owner]

    def holdings(self) -> dict[Hashable, int]:
        return {owner: n for owner, n in self._held.items() if n}

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= self.num_free

    def allocate(self, owner: Hashable, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh blocks for `owner` (idle named ones reclaimed if the free list is
        short); None, and nothing taken, if there are not that many."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > self.num_free:
            return None
        if not num_blocks:
            return []
        self._evict(num_blocks - len(self._free))
        taken = take_from_end(self._free, num_blocks)
        holders = self._holders
        for block in taken:
            holders[block] = Counter({owner: 1})
        self._held[owner] += num_blocks
        return taken

    def free(self, owner: Hashable, blocks: Iterable[int], idle_owners: dict[int, Hashable] | None = None) -> None:
        """Let go of `owner`'s references to `blocks` (a sequence's, in order). A block no one
        holds any more goes idle if it is named, else back to the free list; the last blocks go
        idle first, so that eviction takes a sequence's tail before its prefix, which other
        requests are likelier to share. `idle_owners`: blocks that go idle under another owner
        than `owner` (undoing a share: see share()). Letting go of a block one does not hold is a
        bug in the caller and raises, before anything is changed."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block ids freed twice in one call: {blocks}")
        for block in blocks:
            holders = self._holders.get(block)
            if holders is None:
                raise ValueError(f"block {block} is not allocated")
            if not holders[owner]:
                raise ValueError(f"block {block} is held by {sorted(holders, key=repr)!r}, not {owner!r}")
        for block in reversed(blocks):
            holders = self._holders[block]
            holders[owner] -= 1
            if holders[owner]:
                continue
            del holders[owner]
            self._held[owner] -= 1
            if holders:
                continue
            del self._holders[block]
            if block in self._name_of:
                last = idle_owners.get(block, owner) if idle_owners else owner
                self._idle.setdefault(last, OrderedDict())[block] = None
                self._idle_owner[block] = last
                self._idle_count += 1
                self._keep_within_limit(last)
            else:
                self._free.append(block)

    def owners(self) -> dict[int, dict[Hashable, int]]:
        """Every held block -> {owner: references}: KVBlockPool.owners (idle named blocks are not held)."""
        return {block: {o: n for o, n in holders.items() if n} for block, holders in self._holders.items()}

    def releasable(self, owner: Hashable, blocks: Iterable[int]) -> tuple[int, int]:
        """What letting go of one reference of `owner` on each of `blocks` would give back: blocks
        that would count as free again (no one else holds them), and blocks `owner` would no longer
        hold (its class's count against its cap)."""
        to_pool = to_owner = 0
        for block in blocks:
            holders = self._holders[block]
            if holders[owner] == 1:
                to_owner += 1
                to_pool += len(holders) == 1
        return to_pool, to_owner

    # --- sharing ---------------------------------------------------------------------------------

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The blocks naming the longest prefix of `hashes` (held or idle)."""
        found = []
        block_of = self._block_of
        for name in hashes:
            block = block_of.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def share(self, owner: Hashable, blocks: Iterable[int]) -> dict[int, Hashable]:
        """Take a reference for `owner` on named blocks (from lookup); idle ones are held again
        (they no longer count as free). Returns those that were idle, with the owner they were
        idle under: pass it to free() to undo the share without moving them to another class."""
        woken: dict[int, Hashable] = {}
        for block in blocks:
            if block not in self._name_of:
                raise ValueError(f"block {block} is not named; only named blocks are shared")
            holders = self._holders.get(block)
            if holders is None:
                last = woken[block] = self._idle_owner.pop(block)
                del self._idle[last][block]
                self._idle_count -= 1
                holders = self._holders[block] = Counter()
            if not holders[owner]:
                self._held[owner] += 1
            holders[owner] += 1
        return woken

    def name(self, block: int, name: bytes) -> bool:
        """A held block is now full of computed K/V named `name`: later sequences may share it.
        False (and the block stays unnamed) when another block already holds that content, or the
        block already has a name."""
        if block not in self._holders:
            raise ValueError(f"block {block} is not held; only computed blocks are named")
        if name in self._block_of or block in self._name_of:
            return False
        self._block_of[name] = block
        self._name_of[block] = name
        return True

    def idle(self, owner: Hashable) -> int:
        """Idle named blocks last held by `owner`."""
        idle = self._idle.get(owner)
        return len(idle) if idle else 0

    @property
    def num_named(self) -> int:
        return len(self._name_of)

    # --- eviction --------------------------------------------------------------------------------

    def _keep_within_limit(self, owner: Hashable) -> None:
        limit = self.idle_limits.get(owner)
        idle = self._idle[owner]
        while limit is not None and len(idle) > limit:
            self._drop(owner, idle.popitem(last=False)[0])

    def _evict(self, count: int) -> None:
        """Reclaim `count` idle blocks onto the free list, by eviction order, LRU within a class."""
        for owner in (*self.eviction_order, *(o for o in self._idle if o not in self.eviction_order)):
            idle = self._idle.get(owner)
            while count > 0 and idle:
                self._drop(owner, idle.popitem(last=False)[0])
                count -= 1
            if count <= 0:
                return

    def _drop(self, owner: Hashable, block: int) -> None:
        name = self._name_of.pop(block)
        if self.on_evict is not None:
            self.on_evict(block, name, owner)
        del self._block_of[name]
        del self._idle_owner[block]
        self._idle_count -= 1
        self._free.append(block)
        self.evictions[owner] += 1
