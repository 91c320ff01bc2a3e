"""Decode attention straight from the paged KV cache, on CPU: a small C kernel, built on first use.

The torch path for decodes (services/engine/model.py) copies each sequence's blocks into a padded
buffer (index_select) and runs SDPA over it. SDPA's CPU kernel is built for many query rows; a
decode has one per query head, so it runs far from the memory bandwidth that bounds this work,
and the copy reads and writes the whole context once more. Measured on this project's 2-core
EPYC (2 threads), 32 decodes with 200-384-token contexts, SmolLM2's 3 kv heads x 3 query heads,
per layer: gather 1.4-2.2 ms + SDPA 2.9-3.5 ms; batched matmuls over a head-major copy 2.2-2.7 ms
+ its gather; torch.compile of the whole gather-and-attend (inductor, dynamic shapes) 5.2 ms
after 14-28 s of compiling. The kernel in kernels/paged_decode_attention.c reads K and V once,
in place, with no padding: 1.5-1.9 ms (reading those 19 MB at this machine's ~17 GB/s takes
~1.1 ms). Its first version, a task per (sequence, kv head), ran 4.4-6.5 ms: each task read a
third of every cached slot, and the loads stalled.

    kernel = load_decode_kernel()        # None (with the reason logged) when it cannot be built
    out = kernel(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)

Prompt chunks take the same rows (a token each, at its own context length) through a second
kernel, kernels/paged_prompt_attention.c (load_prompt_kernel()), which tiles a chunk's query rows
against transposed 16-key tiles instead of scoring key by key: measured against SDPA over the
gathered context on this 2-core EPYC, SmolLM2's heads, fp32, per layer: a 136-token prompt 0.21
vs 0.63 ms, 512 tokens 2.0 vs 5.4 ms, a 512-token chunk over 4,096 cached tokens 28 vs 39 ms
(SDPA's figures without its gather); the decode kernel takes 0.53, 6.2 and 92 ms for them.

They are compiled on first use (services/engine/kernel_build.py); each call runs on
torch.get_num_threads() threads. Without a compiler the engine keeps the torch path.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from services.engine.kernel_build import (KernelBuildError, build_library as build_kernel, build_or_exit,
                                          load_once, vector_flags)

SOURCE = Path(__file__).with_name("kernels") / "paged_decode_attention.c"
PROMPT_SOURCE = Path(__file__).with_name("kernels") / "paged_prompt_attention.c"
# -ffast-math: the dot products and exponentials vectorise only so (the C file avoids infinities).
# Compile-time only: linked with it, gcc adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process the moment the library loads (torch's maths included).
_COMPILE_FLAGS = ["-O3", "-ffast-math", "-fPIC", "-fopenmp"]


__all__ = ["PagedKernel", "KernelBuildError", "build_library", "build_prompt_library", "load_decode_kernel",
           "load_prompt_kernel", "prompt_kernel_takes"]


def build_library(compiler: str | None = None) -> Path:
    """Compile the kernel (once per source, flags and machine); returns the shared library."""
    return build_kernel(SOURCE, _COMPILE_FLAGS + vector_flags(), compiler)


def build_prompt_library(compiler: str | None = None) -> Path:
    """The prompt kernel: its micro-tile wants AVX-512's 32 vector registers where the CPU has them."""
    return build_kernel(PROMPT_SOURCE, _COMPILE_FLAGS + vector_flags(avx512=True), compiler)


class PagedKernel:
    """A compiled paged attention kernel (the decode one, or with `entry` the prompt one: same
    arguments) with its argument checks; calls release the GIL (ctypes)."""

    def __init__(self, library: Path, entry: str = "paged_decode_attention"):
        self.path, self.entry = library, entry
        lib = ctypes.CDLL(str(library))
        self._fns = {}            # the cache's dtype -> its entry point (q and out are fp32 in both)
        for dtype, name in ((torch.float32, entry), (torch.bfloat16, entry + "_bf16")):
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
        """q [seqs, kv_heads, group, head_dim]; caches [slots, kv_heads, head_dim]; block_tables
        [seqs, max_blocks] int64; context_lens [seqs] int64. Returns [seqs, kv_heads, group,
        head_dim] in q's dtype. q/k/v are all fp32 or all bf16 (bf16: the kernel widens each value
        and computes in fp32, one rounding at the end). The caller guarantees
        1 <= context_lens[s] <= max_blocks * block_size and block ids inside the cache (the engine
        checks every table before a step): the C code trusts them."""
        num_seqs, kv_heads, group, head_dim = q.shape
        if not (q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in self._fns
                and block_tables.dtype == context_lens.dtype == torch.int64):
            raise TypeError("the decode kernel takes fp32 or bf16 q/k/v (one dtype) and int64 block "
                            "tables and lengths")
        if tuple(k_cache.shape[1:]) != (kv_heads, head_dim) or v_cache.shape != k_cache.shape:
            raise ValueError(f"cache shape {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
        if block_tables.shape[0] != num_seqs or tuple(context_lens.shape) != (num_seqs,):
            raise ValueError("one block table row and one context length per sequence")
        tensors = [t.contiguous() for t in (q.float(), k_cache, v_cache, block_tables, context_lens)]
        if any(t.device.type != "cpu" for t in tensors):
            raise ValueError("the decode kernel runs on CPU tensors only")
        out = torch.empty_like(tensors[0])
        status = self._fns[k_cache.dtype](*(t.data_ptr() for t in tensors), out.data_ptr(), num_seqs, kv_heads,
                                          group, head_dim, block_size, block_tables.shape[1], scale,
                                          torch.get_num_threads())
        if status == 2:
            raise ValueError(f"{self.entry} takes head_dim a multiple of 16 up to 256 and at most 16 query "
                             f"heads per kv head, not {head_dim} and {group}")
        if status != 0:
            raise MemoryError(f"{self.entry} could not allocate its buffers")
        return out.to(q.dtype)


def prompt_kernel_takes(head_dim: int, group: int) -> bool:
    """Whether the prompt kernel takes a model of these shapes (its vectors are 16 wide)."""
    return head_dim % 16 == 0 and head_dim <= 256 and group <= 16


def load_decode_kernel() -> PagedKernel | None:
    """The kernel, built on first use in this process; None (logged once) where it cannot be."""
    return load_once("paged decode attention", lambda: PagedKernel(build_library()), "gather + SDPA")


def load_prompt_kernel() -> PagedKernel | None:
    """The prompt kernel, built on first use in this process; None (logged once) where it cannot be."""
    return load_once("paged prompt attention",
                     lambda: PagedKernel(build_prompt_library(), "paged_prompt_attention"), "SDPA")


if __name__ == "__main__":
    build_or_exit(build_library, "paged decode kernel")
    build_or_exit(build_prompt_library, "paged prompt kernel")
