"""A step's layers, one C call each (kernels/decode_layer.c), on CPU: decodes, and prompt chunks
beside them.

At a decode step's few rows the torch path of a layer (services/engine/model.py) is ~25 small
operations around four matmuls and one attention call, and dispatching them costs more than the
arithmetic: on SmolLM2-135M, 2 EPYC threads, bf16, about 6 ms of a 15 ms step at batch 1. The
C layer runs the norms, rotary, cache writes, residual adds and SiLU as loops over the rows and
calls the engine's linear and decode attention kernels itself (their docstrings have their
figures). bench/engine_paired.py's `fused-layer` change measures the step with and without it.

It takes a step only when every token of it is attended by the paged kernel, each a row of its
own (decodes, and prompt chunks where the same kernel attends them), without LoRA, and only when
every projection runs on the linear kernel (fp32, or bf16 with avx512_bf16): other steps
(streaming windows, SDPA, adapters) keep the torch path. Steps with prompt chunks gained 1.06x
(bf16) and 1.05x (fp32) prompt tok/s at batch 32 (bench/engine_paired.py's `fused-prompts`). The
attention kernel treats every row alike: a prompt token is one row with its own context length,
so a row's result does not depend on its step's other rows. Its results follow the torch path's
rounding (the C file says where its last bits may differ). (The names still say "decode": the
layer ran decode-only steps first.)

    layers = fused_decode_layers(decoder)           # None where it does not apply
    if layers is not None and layers.applies(layout, lora, num_tokens, prompts_in_one_call):
        x = layers.run(x, cos, sin, layout, cache, indices)
"""
from __future__ import annotations

import ctypes
from ctypes import c_float, c_int64, c_void_p
from pathlib import Path
from typing import Iterable

import torch

from services.engine.kernel_build import build_library, build_or_exit, load_once, vector_flags
from services.engine.paged_attention import paged_kernel_takes

SOURCE = Path(__file__).with_name("kernels") / "decode_layer.c"
# No -ffast-math and no contraction: a product then a sum is two roundings, as in torch.
_COMPILE_FLAGS = ["-O3", "-fPIC", "-fopenmp", "-ffp-contract=off"]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", c_int64), ("heads", c_int64), ("kv_heads", c_int64), ("head_dim", c_int64),
                ("intermediate", c_int64), ("eps", c_float), ("scale", c_float), ("bf16", c_int64),
                ("linear", c_void_p), ("attention", c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, c_void_p) for name in ("input_norm", "post_norm", "qkv", "out", "gate_up", "down",
                                              "qkv_bias", "out_bias")]


_SCRATCH = ("h", "qkv", "q", "attended32", "attended", "gate_up", "mixed")


class _Step(ctypes.Structure):
    _fields_ = ([("rows", c_int64), ("block_size", c_int64), ("max_blocks", c_int64)]
                + [(name, c_void_p) for name in ("x", "cos", "sin", "slots", "block_tables", "context_lens")]
                + [(name, c_void_p) for name in _SCRATCH] + [("threads", c_int64)])


class DecodeLayerKernel:
    """The compiled library; a call releases the GIL (ctypes)."""

    def __init__(self, library: Path):
        self.path = library
        lib = ctypes.CDLL(str(library))
        self.decode_layer = lib.decode_layer
        self.decode_layer.restype = ctypes.c_int
        self.decode_layer.argtypes = [c_void_p] * 5
        self.rms_norm_rows = lib.rms_norm_rows
        self.rms_norm_rows.argtypes = [c_void_p] * 3 + [c_int64] * 2 + [c_float, ctypes.c_int, ctypes.c_int]
        self.silu_mul_rows = lib.silu_mul_rows
        self.silu_mul_rows.argtypes = [c_void_p] * 2 + [c_int64] * 2 + [ctypes.c_int, ctypes.c_int]


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class FusedDecodeLayers:
    """The decoder's layers as C structures, built once at load (the tensors stay the model's)."""

    def __init__(self, kernel: DecodeLayerKernel, decoder, linear_address: int, attention_address: int):
        c = decoder.config
        # the kernel it calls for decodes attends the layouts' prompt rows too
        self.prompts_on_kernel = decoder.prompt_kernel is decoder.decode_kernel
        self._kernel, self._call = kernel, kernel.decode_layer
        self._dtype = decoder.dtype
        self._widths = {"h": c.hidden_size, "qkv": (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                        "q": c.num_heads * c.head_dim, "attended32": c.num_heads * c.head_dim,
                        "attended": c.num_heads * c.head_dim, "gate_up": 2 * c.intermediate_size,
                        "mixed": c.intermediate_size}
        self._model = _Model(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                             c.rms_norm_eps, c.head_dim ** -0.5, int(decoder.dtype == torch.bfloat16),
                             linear_address, attention_address)
        self._norms = [(layer.input_norm.contiguous(), layer.post_attention_norm.contiguous())
                       for layer in decoder.layers]      # kept alive: the structures point into them
        self._layers = [_Layer(_pointer(inp), _pointer(post), layer.qkv.packed.data_ptr(),
                               layer.out.packed.data_ptr(), layer.gate_up.packed.data_ptr(),
                               layer.down.packed.data_ptr(), _pointer(layer.qkv.kernel_bias),
                               _pointer(layer.out.kernel_bias))
                        for layer, (inp, post) in zip(decoder.layers, self._norms)]

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm(x) * weight for rows x [T, hidden], as the layer computes it (for the steps that
        keep torch's operations: a row then gets the same bits in every kind of step)."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self._kernel.rms_norm_rows(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                                   self._model.eps, torch.get_num_threads(), self._model.bf16)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows [T, 2 n] of [gate | up], as the layer computes it."""
        gate_up = gate_up.contiguous()
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self._kernel.silu_mul_rows(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1],
                                   torch.get_num_threads(), self._model.bf16)
        return out

    def applies(self, layout, lora, num_tokens: int, prompts_in_one_call: bool) -> bool:
        """Every token of the step a row of the paged kernel (decodes; prompt tokens where the
        decoder attends them by the same kernel, in one call: the torch path pauses between its
        pieces of a long context, the C layer only between layers), and no adapter."""
        rows = sum(part.num_seqs for part in (layout.decodes, layout.prompts) if part is not None)
        return (lora is None and rows == num_tokens and not layout.cached and not layout.fresh
                and (layout.prompts is None or (self.prompts_on_kernel and prompts_in_one_call)))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout, cache,
            indices: Iterable[int]) -> torch.Tensor:
        """The layers in `indices` (the caller's iterator, which may pause between them) over the
        residual stream x [rows, hidden], in place; returns x."""
        rows = x.shape[0]
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        tables, lengths = paged_rows(layout)
        slots = layout.slots.contiguous()
        scratch = {name: torch.empty(rows, width, dtype=torch.float32 if name in ("q", "attended32")
                                     else self._dtype) for name, width in self._widths.items()}
        step = _Step(rows, cache.block_size, tables.shape[1], x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                     slots.data_ptr(), tables.data_ptr(), lengths.data_ptr(),
                     *(scratch[name].data_ptr() for name in _SCRATCH), torch.get_num_threads())
        model, step_ref = ctypes.byref(self._model), ctypes.byref(step)
        for index in indices:
            status = self._call(model, ctypes.byref(self._layers[index]), step_ref,
                                cache.keys[index].data_ptr(), cache.values[index].data_ptr())
            if status != 0:
                raise (MemoryError("the decode attention kernel could not allocate its score buffers")
                       if status < 0 else RuntimeError(f"the linear kernel refused a layer (status {status})"))
        return x


def paged_rows(layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The block tables and context lengths of the step's rows, decodes then prompt tokens (their
    order in the step), as one table zero-padded to the widest."""
    parts = [part for part in (layout.decodes, layout.prompts) if part is not None]
    if len(parts) == 1:
        return parts[0].block_tables.contiguous(), parts[0].context_lens.contiguous()
    width = max(part.block_tables.shape[1] for part in parts)
    tables = torch.cat([torch.nn.functional.pad(part.block_tables, (0, width - part.block_tables.shape[1]))
                        for part in parts])
    return tables, torch.cat([part.context_lens for part in parts])


def build() -> Path:
    return build_library(SOURCE, _COMPILE_FLAGS + vector_flags(avx512=True))


def load_decode_layer_kernel() -> DecodeLayerKernel | None:
    """The kernel, built on first use in this process; None (logged once) where it cannot be."""
    return load_once("fused decode layer", lambda: DecodeLayerKernel(build()), "torch's operations")


def fused_decode_layers(decoder) -> FusedDecodeLayers | None:
    """The decoder's layers for the C layer, where it applies: on CPU, with the paged decode
    kernel (so head_dim is at most the layer's MAX_HEAD_DIM, 256: it rotates a head in a buffer of
    that size), and every projection on the linear kernel in the model's dtype (fp32 or bf16)."""
    linears = [linear for layer in decoder.layers for linear in (layer.qkv, layer.out, layer.gate_up, layer.down)]
    if (decoder.device.type != "cpu" or decoder.decode_kernel is None or not linears
            or not paged_kernel_takes(decoder.config.head_dim, decoder.config.num_heads // decoder.config.num_kv_heads)
            or decoder.dtype not in (torch.float32, torch.bfloat16)
            or any(linear.kernel is None or linear.packed.dtype != decoder.dtype for linear in linears)):
        return None
    kernel = load_decode_layer_kernel()
    if kernel is None:
        return None
    return FusedDecodeLayers(kernel, decoder, linears[0].kernel.address(decoder.dtype),
                             decoder.decode_kernel.address(decoder.dtype))


if __name__ == "__main__":
    build_or_exit(build, "fused decode layer")
