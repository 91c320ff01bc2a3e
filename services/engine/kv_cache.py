"""Paged KV cache: per-layer K and V tensors of fixed-size blocks, addressed by block ids.

The engine never allocates blocks: the scheduler does (services/common/kv_blocks.py) and sends
block tables. Here we only size the cache from a memory budget and hold the tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.config import ModelConfig

DEFAULT_BLOCK_SIZE = 16


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (f"{self.num_blocks} KV blocks x {self.block_size} tokens "
                f"({self.bytes_per_block / 1024:.1f} KiB/block, {self.total_bytes / 2**20:.1f} MiB, "
                f"{self.num_tokens} tokens)")


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    # K and V, for every layer.
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def size_kv_cache(config: ModelConfig, dtype: torch.dtype, budget_bytes: int,
                  block_size: int = DEFAULT_BLOCK_SIZE) -> KVCacheSpec:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    per_block = bytes_per_block(config, block_size, dtype)
    num_blocks = int(budget_bytes // per_block)
    if num_blocks < 1:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes is smaller than one block ({per_block} bytes)")
    return KVCacheSpec(num_blocks=num_blocks, block_size=block_size, bytes_per_block=per_block)


def keys_by_block(keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """Keys by slot [num_blocks * block_size, kv_heads, head_dim] in the paged attention kernel's
    layout, [num_blocks, kv_heads, head_dim, block_size] (a copy)."""
    slots, kv_heads, head_dim = keys.shape
    return keys.view(slots // block_size, block_size, kv_heads, head_dim).permute(0, 2, 3, 1).contiguous()


class PagedKVCache:
    """K/V storage of fixed-size blocks, per layer. A token at position p of a sequence lives in slot
    block_table[p // block_size] * block_size + p % block_size.

    Values: [num_blocks * block_size, kv_heads, head_dim] (a slot's heads side by side). Keys: the
    same on GPU and NPU (torch's path: writes are one index_copy_, reads one index_select of whole
    blocks); with `keys_transposed` (where the paged attention kernel attends: CPU),
    [num_blocks, kv_heads, head_dim, block_size], each block's keys transposed, so that the
    kernel scores 16 keys with one vector load per dimension (services/engine/paged_attention.py).
    Either way a block is one contiguous range of its tensor: whole-block copies (the KV tier)
    do not depend on the layout.
    """

    def __init__(self, config: ModelConfig, spec: KVCacheSpec, device: torch.device,
                 dtype: torch.dtype, keys_transposed: bool = False):
        self.spec = spec
        self.keys_transposed = keys_transposed
        rows = (spec.num_blocks * spec.block_size, config.num_kv_heads, config.head_dim)
        key_shape = ((spec.num_blocks, config.num_kv_heads, config.head_dim, spec.block_size)
                     if keys_transposed else rows)
        self.keys = [torch.zeros(key_shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.values = [torch.zeros(rows, device=device, dtype=dtype) for _ in range(config.num_layers)]

    @property
    def num_blocks(self) -> int:
        return self.spec.num_blocks

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def _slot_keys(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s keys indexed [block, offset, kv head, dimension] (a view)."""
        return self.keys[layer].permute(0, 3, 1, 2)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values [len(slots), kv_heads, head_dim] into those slots."""
        if self.keys_transposed:
            self._slot_keys(layer).index_put_((slots // self.block_size, slots % self.block_size), keys)
        else:
            self.keys[layer].index_copy_(0, slots, keys)
        self.values[layer].index_copy_(0, slots, values)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values in `slots`, each [len(slots), kv_heads, head_dim]."""
        keys = (self._slot_keys(layer)[slots // self.block_size, slots % self.block_size]
                if self.keys_transposed else self.keys[layer][slots])
        return keys, self.values[layer][slots]

    def new_gather_buffers(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialised K and V buffers for `num_blocks` gathered blocks."""
        v = self.values[0]
        row = self.spec.block_size * v.shape[1] * v.shape[2]
        return (torch.empty(num_blocks, row, device=v.device, dtype=v.dtype),
                torch.empty(num_blocks, row, device=v.device, dtype=v.dtype))

    def gather_blocks(self, layer: int, block_ids: torch.Tensor, keys_out: torch.Tensor,
                      values_out: torch.Tensor) -> None:
        """Copy whole blocks of `layer` into the buffers, one row per block, slots in order with
        their heads side by side (keys too, whatever the cache's layout); block by block is
        several times faster than gathering token by token."""
        blocks = self.spec.num_blocks
        if self.keys_transposed:
            gathered = self.keys[layer].index_select(0, block_ids)         # [n, kv, dim, offset]
            keys_out.view(gathered.shape[0], self.block_size, *gathered.shape[1:3]).copy_(gathered.permute(0, 3, 1, 2))
        else:
            torch.index_select(self.keys[layer].view(blocks, -1), 0, block_ids, out=keys_out)
        torch.index_select(self.values[layer].view(blocks, -1), 0, block_ids, out=values_out)
