"""Attention straight from the paged KV cache, on CPU: a small C kernel, built on first use.

The torch path (services/engine/model.py) copies each sequence's blocks into a padded buffer
(index_select) and runs SDPA over it, in every layer. SDPA's CPU kernel is built for many query
rows; a decode has one per query head, so it runs far from the memory bandwidth that bounds this
work, and the copy reads and writes the whole context once more. kernels/paged_attention.c reads
K and V once, in place, for decodes and prompt chunks alike: every query token is a row at its own
context length, and a micro-tile of query rows scores a 16-key tile with one fused multiply-add
per (row, dimension). The cache keeps each block's keys transposed ([kv head][dimension][offset]:
services/engine/kv_cache.py) so that a tile is one vector load per dimension.

Measured on this project's 2-core EPYC (2 threads), SmolLM2's 3 kv heads x 3 query heads, per
layer: 32 decodes over 200-384-token contexts, gather 1.4-2.2 ms + SDPA 2.9-3.5 ms, torch.compile
of gather-and-attend 5.2 ms after 14-28 s of compiling, this kernel's first form (a dot product
per key) 1.5-1.9 ms; prompts against SDPA over the gathered context, fp32: a 136-token prompt
0.21 vs 0.63 ms, 512 tokens 2.0 vs 5.4 ms, a 512-token chunk over 4,096 cached tokens 28 vs 39
ms (SDPA's figures without its gather). It replaced two kernels, one of dot products for decodes
and one that transposed the keys as it read them for prompts; the engine against them, paired:
docs/performance.md (bench/engine_paired.py commit).

    kernel = load_paged_kernel()         # None (with the reason logged) when it cannot be built
    out = kernel(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)

A row's result depends only on that row, so a token is computed the same whatever shares its
step, however its prompt is chunked and when it is recomputed (the C file says how). Compiled on
first use (services/engine/kernel_build.py); each call runs on torch.get_num_threads() threads.
Without a compiler the engine keeps the torch path.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from services.engine.kernel_build import (KernelBuildError, build_library as build_kernel, build_or_exit,
                                          load_once, vector_flags)

SOURCE = Path(__file__).with_name("kernels") / "paged_attention.c"
# -ffast-math: the exponentials vectorise only so (the C file avoids infinities). Compile-time
# only: linked with it, gcc adds crtfastmath.o, whose constructor turns on flush-to-zero for the
# whole process the moment the library loads (torch's maths included).
_COMPILE_FLAGS = ["-O3", "-ffast-math", "-fPIC", "-fopenmp"]


__all__ = ["PagedKernel", "KernelBuildError", "build_library", "load_paged_kernel", "paged_kernel_takes"]


def build_library(compiler: str | None = None, source: Path | None = None) -> Path:
    """Compile the kernel (once per source, flags and machine); returns the shared library. Its
    micro-tile wants AVX-512's 32 vector registers where the CPU has them. (`source`: another
    version of paged_attention.c, as bench/attention_rows.py builds a commit's, with the same flags.)"""
    return build_kernel(source or SOURCE, _COMPILE_FLAGS + vector_flags(avx512=True), compiler)


class PagedKernel:
    """The compiled kernel with its argument checks; calls release the GIL (ctypes)."""

    def __init__(self, library: Path):
        self.path = library
        lib = ctypes.CDLL(str(library))
        self._fns = {}            # the cache's dtype -> its entry point (q and out are fp32 in both)
        for dtype, name in ((torch.float32, "paged_attention"), (torch.bfloat16, "paged_attention_bf16")):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
            self._fns[dtype] = fn

    def address(self, cache_dtype: torch.dtype) -> int:
        """The C entry point for a cache of `cache_dtype`, for a kernel that calls it
        (kernels/decode_layer.c)."""
        return ctypes.cast(self._fns[cache_dtype], ctypes.c_void_p).value

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                 scale: float) -> torch.Tensor:
        """q [rows, kv_heads, group, head_dim]; k_cache [blocks, kv_heads, head_dim, block_size]
        (keys transposed within each block: PagedKVCache's layout where this kernel attends);
        v_cache [blocks * block_size, kv_heads, head_dim]; block_tables [rows, max_blocks] int64;
        context_lens [rows] int64. Returns [rows, kv_heads, group, head_dim] in q's dtype. q/k/v
        are all fp32 or all bf16 (bf16: the kernel widens each value and computes in fp32, one
        rounding at the end). The caller guarantees 1 <= context_lens[s] <= max_blocks *
        block_size and block ids inside the cache (the engine checks every table before a step):
        the C code trusts them."""
        num_rows, kv_heads, group, head_dim = q.shape
        if not (q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in self._fns
                and block_tables.dtype == context_lens.dtype == torch.int64):
            raise TypeError("the paged attention kernel takes fp32 or bf16 q/k/v (one dtype) and int64 "
                            "block tables and lengths")
        if (tuple(k_cache.shape[1:]) != (kv_heads, head_dim, block_size)
                or tuple(v_cache.shape) != (k_cache.shape[0] * block_size, kv_heads, head_dim)):
            raise ValueError(f"cache shapes {tuple(k_cache.shape)} (keys) and {tuple(v_cache.shape)} (values) "
                             f"do not match q {tuple(q.shape)} and block size {block_size}")
        if block_tables.shape[0] != num_rows or tuple(context_lens.shape) != (num_rows,):
            raise ValueError("one block table row and one context length per row")
        tensors = [t.contiguous() for t in (q.float(), k_cache, v_cache, block_tables, context_lens)]
        if any(t.device.type != "cpu" for t in tensors):
            raise ValueError("the paged attention kernel runs on CPU tensors only")
        out = torch.empty_like(tensors[0])
        status = self._fns[k_cache.dtype](*(t.data_ptr() for t in tensors), out.data_ptr(), num_rows, kv_heads,
                                          group, head_dim, block_size, block_tables.shape[1], scale,
                                          torch.get_num_threads())
        if status == 2:
            raise ValueError(f"the paged attention kernel takes head_dim a multiple of 16 up to 256 and at "
                             f"most 16 query heads per kv head, not {head_dim} and {group}")
        if status != 0:
            raise MemoryError("the paged attention kernel could not allocate its buffers")
        return out.to(q.dtype)


def paged_kernel_takes(head_dim: int, group: int) -> bool:
    """Whether the kernel takes a model of these shapes (its vectors are 16 wide)."""
    return head_dim % 16 == 0 and head_dim <= 256 and group <= 16


def load_paged_kernel() -> PagedKernel | None:
    """The kernel, built on first use in this process; None (logged once) where it cannot be."""
    return load_once("paged attention", lambda: PagedKernel(build_library()), "gather + SDPA")


if __name__ == "__main__":
    build_or_exit(build_library, "paged attention kernel")
