"""The scheduler's side of a worker's second KV tier (the worker's: services/engine/kv_tier.py).

The pool holds a fraction of what real traffic would reuse: a conversation's next turn often
comes after its blocks were evicted. With a tier, a named block the pool evicts is first copied
to a tier slot under the same name (a save); a request whose cached prefix continues in the tier
gets fresh pool blocks that are copied back from it (a load) instead of computing those tokens.
Names already carry the cache scope (tenant and cache_salt), the adapter and its load generation
(prefix_cache.py), and a tier belongs to one worker connection: a reconnected or restarted
worker is a new pool with an empty tier, so a block computed under other weights is never loaded.

Like the pool, the slots are allocated here and the worker only copies: the copies recorded while
a plan is built go in that plan (StepPlan.tier_*), in the order they were recorded, and the
worker does them before the plan's computing. That order is what keeps them right: a block
evicted and given out again in the same plan is saved before it is overwritten, a slot freed by a
load is written again only by a later save, a block loaded and then evicted within one plan is
saved after its load.

Retention is by class, as the pool's: Low's least recently saved slots go first, then Medium's,
then High's, and each class keeps at most its idle share of the tier (the pool's idle_shares).

Loading is done only when it is cheaper than computing: the worker measures the copy of a block
back into its pool when it starts (WorkerInfo.kv_tier_load_us_per_block); the scheduler follows
its steps' forward time per token computed. A block is loaded while its copy costs less than
computing its tokens (with no step measured yet, it is loaded). Pure Python, no torch.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence

FADE = 0.9              # weight left to older steps in the per-token estimate


class KVTierMirror:
    """What one worker's tier holds, by name, and the copies its next plan must carry."""

    def __init__(self, num_slots: int, block_size: int, eviction_order: Sequence[Hashable],
                 limits: dict[Hashable, int] | None = None, load_us_per_block: float = 0.0,
                 totals: tuple[Counter, Counter, Counter] | None = None):
        self.num_slots = num_slots
        self.block_size = block_size
        self.eviction_order = list(eviction_order)
        self.limits = dict(limits or {})
        self.load_us_per_block = load_us_per_block
        self.us_per_token = 0.0                       # computing, from the steps seen (0: none yet)
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[bytes, int] = {}
        self._by_class: dict[Hashable, OrderedDict] = {owner: OrderedDict() for owner in self.eviction_order}
        self._class_of: dict[bytes, Hashable] = {}
        self.blocks: list[int] = []                   # the copies to send, in order
        self.slots: list[int] = []
        self.loads: list[bool] = []
        # Blocks saved, loaded and dropped per class: `totals`, counted over every connection
        # (the scheduler's metrics), else this mirror's own.
        self.saved, self.loaded, self.dropped = totals or (Counter(), Counter(), Counter())

    # --- what it holds --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, name: bytes) -> bool:
        return name in self._slot_of

    def held(self, owner: Hashable) -> int:
        entries = self._by_class.get(owner)
        return len(entries) if entries else 0

    def run(self, names: Sequence[bytes]) -> int:
        """How many of `names`, from the first, the tier holds."""
        count = 0
        while count < len(names) and names[count] in self._slot_of:
            count += 1
        return count

    # --- copies ---------------------------------------------------------------------------------

    def save(self, block: int, name: bytes, owner: Hashable) -> None:
        """The pool evicts `block`, named `name`, last held by `owner`: keep its K/V in a slot
        (the tier's least recently saved, lowest class first, if none is free)."""
        if name in self._slot_of:           # saved before and loaded since: the same K/V
            entries = self._by_class[self._class_of[name]]
            entries.move_to_end(name)
            return
        if not self._free and not self._drop_one():
            return
        slot = self._free.pop()
        self._slot_of[name] = slot
        self._class_of[name] = owner
        self._by_class.setdefault(owner, OrderedDict())[name] = None
        self._record(block, slot, False)
        self.saved[owner] += 1
        limit = self.limits.get(owner)
        while limit is not None and len(self._by_class[owner]) > limit:
            self._drop(owner, next(iter(self._by_class[owner])))

    def take(self, names: Sequence[bytes]) -> list[int]:
        """The slots holding `names` (all held: see run()), taken out of the tier: call loaded()
        with the pool blocks they go to before anything else is recorded or saved."""
        slots = []
        for name in names:
            slots.append(self._slot_of.pop(name))
            del self._by_class[self._class_of.pop(name)][name]
        return slots

    def loaded_into(self, slots: list[int], blocks: list[int], owner: Hashable) -> None:
        """Copy `slots` back into pool `blocks` (one each), then free the slots (a later save may
        use them: it comes after these loads in the plan)."""
        for slot, block in zip(slots, blocks):
            self._record(block, slot, True)
        self._free.extend(reversed(slots))
        self.loaded[owner] += len(slots)

    def take_copies(self) -> tuple[list[int], list[int], list[bool]]:
        """The copies recorded since the last call, for the plan being finished."""
        copies = self.blocks, self.slots, self.loads
        self.blocks, self.slots, self.loads = [], [], []
        return copies

    # --- when loading pays ----------------------------------------------------------------------

    def note_step(self, tokens: int, forward_ms: float) -> None:
        """A step that computed `tokens` tokens in `forward_ms` (prefill-sized ones inform best)."""
        if tokens >= self.block_size and forward_ms > 0:
            sample = forward_ms * 1000 / tokens
            self.us_per_token = sample if not self.us_per_token else FADE * self.us_per_token + (1 - FADE) * sample

    @property
    def worth_loading(self) -> bool:
        return not self.us_per_token or self.load_us_per_block < self.us_per_token * self.block_size

    # --- inside ---------------------------------------------------------------------------------

    def _record(self, block: int, slot: int, load: bool) -> None:
        self.blocks.append(block)
        self.slots.append(slot)
        self.loads.append(load)

    def _drop_one(self) -> bool:
        for owner in (*self.eviction_order, *(o for o in self._by_class if o not in self.eviction_order)):
            entries = self._by_class.get(owner)
            if entries:
                self._drop(owner, next(iter(entries)))
                return True
        return False

    def _drop(self, owner: Hashable, name: bytes) -> None:
        del self._by_class[owner][name]
        del self._class_of[name]
        self._free.append(self._slot_of.pop(name))
        self.dropped[owner] += 1
