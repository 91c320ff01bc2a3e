"""The model's linear layers on CPU through kernels/linear.c, over weights packed once at load.

At a decode step every weight is multiplied by a handful of rows, and the step is bound by
reading the weights. oneDNN's prepacked matmul (services/engine/linear.py) reads them at 12-20
GB/s at one row on the 2-core EPYC this was written on (a plain sum reads 28-34 GB/s), and its
primitives change with the row count. The kernel streams a weight packed in blocks of 16 output
rows (kernels/linear.c says the layout) with no horizontal sums: on SmolLM2-135M's 30 layers'
shapes, 2 threads, bf16, one row 9.7 vs 18.3 ms, 8 rows 11.7 vs 14.9, 32 rows 26.7 vs 32.8,
512 rows 328 vs 326 (332 GFLOPS, the measured matmul peak); fp32 one row 14.9 vs 22.6 ms, 32
rows 42 vs 45, 512 rows 559 vs 518 (7% slower there). A row's result does not depend on the
other rows of its batch. bf16 only where the CPU has avx512_bf16 (vdpbf16ps); fp32 anywhere
the kernel builds.

    kernel = load_linear_kernel()          # None (with the reason logged) when it cannot be built
    packed = kernel.pack(weight)           # [N, K] fp32 or bf16 -> the packed copy
    y = kernel(x, packed, bias, out_features)
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from services.engine.host_memory import huge_page_buffer, release_freed_memory
from services.engine.kernel_build import build_library, build_or_exit, load_once, vector_flags

SOURCE = Path(__file__).with_name("kernels") / "linear.c"
# No -ffast-math: each output's sum keeps its order, so results are the same in any batch.
_COMPILE_FLAGS = ["-O3", "-fPIC", "-fopenmp"]
LANES, TILE = 16, 32          # outputs per vector; outputs per tile (the packed N's multiple)


class LinearKernel:
    """The compiled kernel; calls release the GIL (ctypes) and run on torch's thread count."""

    def __init__(self, library: Path):
        self.path = library
        lib = ctypes.CDLL(str(library))
        self._fns = {torch.float32: lib.linear_f32, torch.bfloat16: lib.linear_bf16}
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.linear_has_bf16.restype = ctypes.c_int
        self.dtypes = {torch.float32} | ({torch.bfloat16} if lib.linear_has_bf16() else set())

    def address(self, dtype: torch.dtype) -> int:
        """The C entry point for `dtype`, for a kernel that calls it (kernels/decode_layer.c)."""
        return ctypes.cast(self._fns[dtype], ctypes.c_void_p).value

    def supports(self, weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in self.dtypes
                and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0))

    @staticmethod
    def packed_numel(weight: torch.Tensor) -> int:
        """Elements of the packed copy of `weight` [N, K] (N padded to a multiple of 32)."""
        return -(-weight.shape[0] // TILE) * TILE * weight.shape[1]

    @staticmethod
    def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] -> blocks of 16 output rows interleaved along K (fp32: [N/16, K, 16]; bf16:
        [N/16, K/2, 16, 2]), N zero-padded to a multiple of 32; written into `out` (a flat
        buffer of packed_numel elements) when given."""
        n, k = weight.shape
        padded = weight.contiguous()
        if n % TILE:
            padded = torch.zeros(-(-n // TILE) * TILE, k, dtype=weight.dtype)
            padded[:n] = weight
        if weight.dtype == torch.bfloat16:
            blocks = padded.view(-1, LANES, k // 2, 2).permute(0, 2, 1, 3)
        else:
            blocks = padded.view(-1, LANES, k).permute(0, 2, 1)
        return blocks.contiguous() if out is None else out.view(blocks.shape).copy_(blocks)

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
        """x [M, K] of the packed weight's dtype; bias fp32 [N] or None. Returns [M, N]."""
        if x.dtype != packed.dtype or x.dim() != 2 or x.device.type != "cpu":
            raise TypeError(f"the linear kernel takes a 2-D CPU input of {packed.dtype}, "
                            f"got {tuple(x.shape)} {x.dtype} on {x.device}")
        in_features = packed.shape[1] * (2 if packed.dtype == torch.bfloat16 else 1)
        if x.shape[1] != in_features:
            raise ValueError(f"input has {x.shape[1]} features, the weight {in_features}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        status = self._fns[x.dtype](packed.data_ptr(), x.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                    out.data_ptr(), x.shape[0], out_features, in_features,
                                    torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"the linear kernel refused its arguments (status {status})")
        return out


def place_on_huge_pages(layers: list) -> int:
    """Pack the kernel's `layers` (Linear) into one buffer on 2 MiB pages
    (host_memory.huge_page_buffer), in order, so a decode step reads them as one stream; returns
    the buffer's bytes. A layer built with pack_later is packed straight into its place (the
    model's do that: no second copy of the weights exists while loading); one packed already is
    moved there, and its own allocation freed and handed back to the kernel."""
    kernel_layers = [layer for layer in layers if layer.kernel is not None]
    dtypes = {layer.kernel_dtype for layer in kernel_layers}
    if len(dtypes) != 1:
        for layer in kernel_layers:
            layer.pack_into(None)
        return 0
    sizes = [LinearKernel.packed_numel(layer.weight) if layer.packed is None else layer.packed.numel()
             for layer in kernel_layers]
    buffer = huge_page_buffer(sum(sizes), dtypes.pop())
    offset = 0
    for layer, size in zip(kernel_layers, sizes):
        layer.pack_into(buffer[offset:offset + size])
        offset += size
    release_freed_memory()
    return buffer.numel() * buffer.element_size()


def build(source: Path = SOURCE) -> Path:
    """The kernel's library (`source`: another version of linear.c, as bench/linear_rows.py
    builds a commit's, with the same flags)."""
    return build_library(source, _COMPILE_FLAGS + vector_flags(avx512=True))


def load_linear_kernel() -> LinearKernel | None:
    """The kernel, built on first use in this process; None (logged once) where it cannot be."""
    return load_once("linear layers", lambda: LinearKernel(build()), "oneDNN")


if __name__ == "__main__":
    build_or_exit(build, "linear kernel")
