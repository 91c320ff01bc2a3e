"""Linear layers, with weights packed once at load on CPU: for the engine's C kernel where it
builds (services/engine/linear_kernel.py: fp32 anywhere, bf16 with avx512_bf16), else for oneDNN.

On the 2-core AMD EPYC we develop on, torch's default CPU matmul (MKL) runs the model's shapes
1.3-3x slower than oneDNN with a prepacked weight (measured: decode at batch 32, 576x3072 takes
1.30 ms vs 0.57 ms; the 49152-row output head 33 ms vs 11 ms). The prepacked path is used on
CPU in fp32, and in bf16 where oneDNN multiplies bf16 natively (avx512_bf16, AMX), when this
torch build has it and it reproduces F.linear on a probe input; otherwise, and on accelerators,
plain F.linear. The C kernel, where it applies, reads the weights faster than either at the
few rows of a decode step and as fast at a prompt's hundreds (its docstring has the figures).

oneDNN, and ideep (torch's wrapper around it), also cache one compiled primitive per input shape,
1,024 of each by default, and a step's token count is anything from 1 to the step budget: a CPU
worker's resident memory grew with every shape it met (about 0.5 MB per cached primitive; 14%
over a 20-minute soak of bench/chaos.py, still rising). bound_onednn_caches() keeps CACHE_CAPACITY
of each; bench/onednn_cache.py measures what that costs in step time (paired runs).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from services.engine.linear_kernel import LinearKernel, load_linear_kernel

log = logging.getLogger(__name__)

CACHE_CAPACITY = 128
_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")   # oneDNN's, ideep's


def bound_onednn_caches(capacity: int = CACHE_CAPACITY) -> dict[str, str]:
    """Bound oneDNN's and ideep's primitive caches; a value already in the environment (the
    operator's) is kept. Both libraries read it when they first build a primitive, so this must
    run before the first oneDNN call of the process (the engine calls it before loading weights).
    Returns the capacities in effect."""
    for name in _CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in _CACHE_VARIABLES}


# Probe tolerance per dtype: fp32 sums in another order; bf16 rounds its output (8-bit mantissa).
_PROBE_RTOL = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}


def _onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _packs(dtype: torch.dtype) -> bool:
    """bf16 only where oneDNN has native bf16: elsewhere it emulates it, slower than F.linear."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """y = x @ weight.T + bias for 2-D x."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True,
                 pack_later: bool = False):
        """`pack_later`: where the C kernel takes the weight, leave the packing to pack_into (the
        model packs all its layers into one buffer: linear_kernel.place_on_huge_pages)."""
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight = weight
        self.packed = None
        self.kernel: LinearKernel | None = None
        if not (prepack and weight.device.type == "cpu"):
            return
        kernel = load_linear_kernel()
        if kernel is not None and kernel.supports(weight):
            self.kernel, self.kernel_dtype = kernel, weight.dtype
            self.kernel_bias = None if bias is None else bias.float().contiguous()   # added to the fp32 sums
            if not pack_later:
                self.pack_into(None)
        elif _onednn_available() and _packs(weight.dtype):
            self.packed = self._pack(weight, bias)

    def pack_into(self, out: torch.Tensor | None) -> None:
        """Pack the weight for the kernel into `out` (a flat buffer of its packed size), or into an
        allocation of its own (None); a layer packed already moves its packed copy there."""
        if self.packed is None:
            self.packed = self.kernel.pack(self.weight, out)
            self.weight = None      # the packed copy replaces it (unless shared: the tied head)
        elif out is not None:
            self.packed = out.view(self.packed.shape).copy_(self.packed)

    @property
    def backend(self) -> str:
        return "kernel" if self.kernel is not None else "onednn" if self.packed is not None else "torch"

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            probe = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "").float()
            want = F.linear(probe, weight, bias).float()
            tolerance = _PROBE_RTOL[weight.dtype]
            if not torch.allclose(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item()):
                raise RuntimeError(f"max abs diff {(got - want).abs().max().item():.3g}")
        except RuntimeError as exc:
            log.warning("oneDNN linear unavailable (%s); using F.linear", exc)
            return None
        # The packed copy replaces the dense weight, unless someone else shares it (tied head).
        self.weight = None
        return packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.packed, self.kernel_bias, self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
