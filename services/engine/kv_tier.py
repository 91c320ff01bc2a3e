"""The second KV tier: host memory (or a memory-mapped file on local disk) beside the device's
paged KV cache, where blocks the pool evicts are kept, to be copied back instead of recomputed.

Like the pool, the tier's slots are allocated by the scheduler (services/scheduler/kv_tier.py),
which knows what each holds by name; a worker only copies when a plan says so. A plan carries its
copies as parallel arrays (StepPlan.tier_*), done in order before anything else in the plan: a
save copies pool block -> tier slot (a block the pool evicted, before this plan reuses it), a load
copies tier slot -> pool block (a prefix found in the tier, before this plan computes after it).

Layout: one row per slot holding every layer's K and V of one block ([slots, layers, 2, row]), so
a slot is one contiguous run of bytes (a page-friendly unit on disk). On CUDA the host memory is
pinned, so copies are DMA. What the tier holds does not outlive the process: a worker that starts
again is a new pool to its scheduler, tier included.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from services.engine.kv_cache import PagedKVCache


class KVTier:
    def __init__(self, cache: PagedKVCache, num_slots: int, path: str | None = None):
        if num_slots <= 0:
            raise ValueError(f"a KV tier needs at least one slot, got {num_slots}")
        keys = cache.keys[0]
        self.cache = cache
        self.num_slots = num_slots
        self.path = path
        self.layers = len(cache.keys)
        self.row = cache.block_size * keys.shape[1] * keys.shape[2]
        shape = (num_slots, self.layers, 2, self.row)
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            count = num_slots * self.layers * 2 * self.row
            # shared=True: a file of exactly this size, written through the page cache.
            self.slots = torch.from_file(path, shared=True, size=count, dtype=keys.dtype).view(shape)
        else:
            self.slots = torch.empty(shape, dtype=keys.dtype, pin_memory=keys.device.type == "cuda")
        self.saved = self.loaded = 0
        self.copy_seconds = 0.0

    @classmethod
    def sized(cls, cache: PagedKVCache, budget_bytes: int, path: str | None = None) -> KVTier | None:
        """A tier of as many blocks as `budget_bytes` holds (None for 0 or less than one block)."""
        slots = budget_bytes // cache.spec.bytes_per_block
        return cls(cache, int(slots), path) if slots > 0 else None

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def check(self, blocks, slots) -> None:
        """Refuse (ValueError) copies that name a block or slot out of range."""
        if len(blocks) != len(slots):
            raise ValueError(f"tier copies: {len(blocks)} blocks for {len(slots)} slots")
        if blocks and max(blocks) >= self.cache.num_blocks:
            raise ValueError(f"tier copy of block {max(blocks)}: the pool has {self.cache.num_blocks}")
        if slots and max(slots) >= self.num_slots:
            raise ValueError(f"tier copy of slot {max(slots)}: the tier has {self.num_slots}")

    def copy(self, blocks, slots, loads) -> None:
        """Do the copies in order (`loads[i]`: slot -> block, else block -> slot), batched into
        runs of one direction that touch no block or slot twice."""
        started = time.perf_counter()
        run_blocks: list[int] = []
        run_slots: list[int] = []
        direction = None
        for block, slot, load in zip(blocks, slots, loads):
            if (load != direction or block in run_blocks or slot in run_slots) and run_blocks:
                self._copy_run(run_blocks, run_slots, direction)
                run_blocks, run_slots = [], []
            direction = load
            run_blocks.append(block)
            run_slots.append(slot)
        if run_blocks:
            self._copy_run(run_blocks, run_slots, direction)
        self.copy_seconds += time.perf_counter() - started

    def _copy_run(self, blocks: list[int], slots: list[int], load: bool) -> None:
        device = self.cache.keys[0].device
        block_index = torch.tensor(blocks, device=device)
        slot_index = torch.tensor(slots)
        num_blocks = self.cache.num_blocks
        for layer in range(self.layers):
            for kind, tensors in enumerate((self.cache.keys, self.cache.values)):
                pool = tensors[layer].view(num_blocks, -1)
                tier = self.slots[:, layer, kind]
                if load:
                    pool.index_copy_(0, block_index, tier.index_select(0, slot_index).to(device, non_blocking=True))
                else:
                    tier.index_copy_(0, slot_index, pool.index_select(0, block_index).to("cpu"))
        if load:
            self.loaded += len(blocks)
        else:
            self.saved += len(blocks)

    def measure(self, blocks: int = 32, repeats: int = 3) -> float:
        """Seconds to copy one block from the tier back into the pool, measured here: the best of
        `repeats` loads of `blocks` blocks, after saving them (so the pool's contents are put back
        as they were; a worker measures before its first step)."""
        count = min(blocks, self.num_slots, self.cache.num_blocks)
        indices = list(range(count))
        device = self.cache.keys[0].device
        self._copy_run(indices, indices, False)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            self._copy_run(indices, indices, True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - started)
        self.saved -= count
        self.loaded -= count * repeats
        return best / count
