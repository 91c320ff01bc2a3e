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


class PagedKVCache:
    """K/V storage: for each layer a [num_blocks * block_size, kv_heads, head_dim] tensor.

    A token at position p of a sequence lives in slot block_table[p // block_size] * block_size
    + p % block_size. Keeping slots flat makes both writes (index_copy_) and reads (index_select of
    a sequence's slots) single kernels.
    """

    def __init__(self, config: ModelConfig, spec: KVCacheSpec, device: torch.device,
                 dtype: torch.dtype):
        self.spec = spec
        shape = (spec.num_blocks * spec.block_size, config.num_kv_heads, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]

    @property
    def num_blocks(self) -> int:
        return self.spec.num_blocks

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys[layer].index_copy_(0, slots, keys)
        self.values[layer].index_copy_(0, slots, values)

    def new_gather_buffers(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialised K and V buffers for `num_blocks` gathered blocks."""
        k = self.keys[0]
        row = self.spec.block_size * k.shape[1] * k.shape[2]
        return (torch.empty(num_blocks, row, device=k.device, dtype=k.dtype),
                torch.empty(num_blocks, row, device=k.device, dtype=k.dtype))

    def gather_blocks(self, layer: int, block_ids: torch.Tensor, keys_out: torch.Tensor,
                      values_out: torch.Tensor) -> None:
        """Copy whole blocks of `layer` into the buffers: one contiguous row per block, which is
        several times faster than gathering token by token."""
        blocks = self.spec.num_blocks
        torch.index_select(self.keys[layer].view(blocks, -1), 0, block_ids, out=keys_out)
        torch.index_select(self.values[layer].view(blocks, -1), 0, block_ids, out=values_out)
