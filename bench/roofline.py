"""The roofline of bench/engine_throughput.py: what this machine's matmuls and memory can do at the
model's own shapes, what work each engine step had to do, and how close a phase came.

    peak = matmul_peak(config, dtype, device, sync, rows=(32, 512))   # GFLOPS, best of REPEATS
    gb_s = memory_bandwidth(device, sync)                              # GB/s reading a large tensor
    work = [step_work(config, entries, dtype) for entries in steps]   # FLOPs and bytes per step
    point = phase_roofline(work, seconds, peak.gflops, gb_s)           # achieved, bound, share of roof

Counting (useful work only: what the model needs, not what padding or re-reads add), per step,
from the (position, tokens, samples) of each sequence in it:
- FLOPs: 2 per multiply-add. Every computed token runs every layer's linear layers: 2 x their
  parameters. The output head runs only for the rows that are sampled (a decode, a prompt's
  last chunk): 2 x vocab x hidden each. Attention, per layer, for a query at position p over its
  p + 1 keys: 2 x heads x head_dim x (p + 1) for the scores and as many for the weighted sum.
  Norms, rotary embeddings, activations and sampling are left out (under 1% here).
- Bytes: the step reads every layer weight once, the output head's once if anything samples (at
  the dtype's size), and each sequence's cached K and V before its position once. Activations
  and a chunk's own K/V are taken to stay in the caches.
- Roof: a step cannot take less than max(FLOPs / matmul peak, bytes / bandwidth); a phase's roof
  time is the sum over its steps, and the phase is called compute- or bandwidth-bound by which
  kind of step makes up most of that time.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.config import ModelConfig
from services.engine.linear import Linear

REPEATS = 5                     # timings are the best of this many (the least disturbed)
MIN_TIMED_SECONDS = 0.02        # each timing repeats its call until it lasts at least this long
BANDWIDTH_BYTES = 512 << 20     # read by the bandwidth probe: far larger than any CPU cache
MIXED_ROWS = 32                 # the output head's rows in a step: at most one per running sequence


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of the engine's matmuls, fused as it runs them (q/k/v in one,
    gate/up in one; services/engine/model.py)."""
    c = config
    return {
        "qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
        "o": (c.hidden_size, c.num_heads * c.head_dim),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "lm_head": (c.vocab_size, c.hidden_size),
    }


def layer_parameters(config: ModelConfig) -> int:
    """Weights of the decoder layers' linear layers (all layers; biases and norms left out)."""
    shapes = linear_shapes(config)
    return config.num_layers * sum(o * i for name, (o, i) in shapes.items() if name != "lm_head")


def head_parameters(config: ModelConfig) -> int:
    return config.vocab_size * config.hidden_size


def best_seconds(call: Callable[[], object], sync: Callable[[], None]) -> float:
    """Seconds per call: the best of REPEATS timings, each of enough calls to last
    MIN_TIMED_SECONDS (after one untimed call: kernel selection, first-touch memory)."""
    call()
    sync()
    started = time.perf_counter()
    call()
    sync()
    calls = max(1, int(MIN_TIMED_SECONDS / max(time.perf_counter() - started, 1e-6)))
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def linear_gflops(rows: int, shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
                  sync: Callable[[], None]) -> tuple[float, str]:
    """The faster of F.linear and the engine's Linear (its C kernel or oneDNN on a prepacked
    weight, where they apply: services/engine/linear.py) on one shape, in GFLOPS, and which it
    was ("engine Linear (kernel)", "engine Linear (onednn)" or "F.linear")."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    x = torch.randn(rows, shape[1], generator=generator).to(device=device, dtype=dtype)
    flops = 2.0 * rows * shape[0] * shape[1]
    candidates = {"F.linear": lambda: F.linear(x, weight)}
    engine_linear = Linear(weight, prepack=True)
    if engine_linear.packed is not None:
        candidates[f"engine Linear ({engine_linear.backend})"] = lambda: engine_linear(x)
    speeds = {name: flops / best_seconds(call, sync) / 1e9 for name, call in candidates.items()}
    fastest = max(speeds, key=speeds.get)
    return speeds[fastest], fastest


@dataclass(frozen=True, slots=True)
class MatmulPeak:
    gflops: float                               # the best of by_rows: the dtype's matmul roof
    rows: int                                   # ... reached at this many rows per step
    by_rows: dict[int, float]                   # a whole step's linears, FLOP-weighted, per row count
    by_shape: dict[str, dict[str, float | str]]  # "gate_up@32" -> GFLOPS and the faster kernel


def matmul_peak(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                sync: Callable[[], None], rows: tuple[int, ...]) -> MatmulPeak:
    """GFLOPS of one step's linear layers at each row count (the decoder layers at `rows`, the
    output head at no more than MIXED_ROWS, as the engine samples): the step's FLOPs over the
    sum of each matmul's best time, so that each shape counts by its share of the work."""
    by_rows, by_shape = {}, {}
    for m in rows:
        flops = seconds = 0.0
        for name, shape in linear_shapes(config).items():
            count, shape_rows = (1, min(m, MIXED_ROWS)) if name == "lm_head" else (config.num_layers, m)
            key = f"{name}@{shape_rows}"
            if key not in by_shape:           # the head's shape recurs at every row count
                gflops, kernel = linear_gflops(shape_rows, shape, dtype, device, sync)
                by_shape[key] = {"gflops": gflops, "kernel": kernel}
            work = 2.0 * shape_rows * shape[0] * shape[1] * count
            flops += work
            seconds += work / (by_shape[key]["gflops"] * 1e9)
        by_rows[m] = flops / seconds / 1e9
    best = max(by_rows, key=by_rows.get)
    return MatmulPeak(by_rows[best], best, by_rows, by_shape)


def memory_bandwidth(device: torch.device, sync: Callable[[], None]) -> float:
    """GB/s reading BANDWIDTH_BYTES of fp32 (a sum: the bytes are read once, nothing written
    back), as the weights are read by a decode step."""
    data = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32, device=device)
    return BANDWIDTH_BYTES / best_seconds(lambda: data.sum(), sync) / 1e9


@dataclass(frozen=True, slots=True)
class StepWork:
    flops: float
    bytes: float


def step_work(config: ModelConfig, entries: list[tuple[int, int, bool]], dtype: torch.dtype) -> StepWork:
    """What one engine step had to compute and read (the counting of the module docstring), from
    each sequence's (position of its first token, tokens computed, whether it samples)."""
    c = config
    element = torch.empty((), dtype=dtype).element_size()
    tokens = sum(n for _, n, _ in entries)
    sampled = sum(1 for *_, samples in entries if samples)
    # Queries at positions position .. position + n - 1 see position + 1 .. position + n keys.
    keys = sum(n * position + n * (n + 1) / 2 for position, n, _ in entries)
    flops = (2.0 * layer_parameters(c) * tokens + 2.0 * head_parameters(c) * sampled
             + c.num_layers * 4.0 * c.num_heads * c.head_dim * keys)
    cached_tokens = sum(position for position, _, _ in entries)
    read = (layer_parameters(c) + (head_parameters(c) if sampled else 0)) * element
    read += 2 * c.num_layers * c.num_kv_heads * c.head_dim * element * cached_tokens
    return StepWork(flops, read)


@dataclass(frozen=True, slots=True)
class RooflinePoint:
    achieved_gflops: float
    achieved_gb_s: float
    flop_per_byte: float          # the phase's FLOPs over its bytes
    bound: str                    # "compute" or "bandwidth": the kind of step most of the roof time is
    roof_gflops: float            # the phase's FLOPs over its roof time: the most it could achieve
    of_roof: float                # achieved / roof
    of_peak: float                # achieved / matmul peak


def phase_roofline(steps: list[StepWork], seconds: float, peak_gflops: float,
                   bandwidth_gb_s: float) -> RooflinePoint:
    flops, read = sum(s.flops for s in steps), sum(s.bytes for s in steps)
    compute_seconds = memory_seconds = 0.0
    for step in steps:
        compute, memory = step.flops / (peak_gflops * 1e9), step.bytes / (bandwidth_gb_s * 1e9)
        if compute >= memory:
            compute_seconds += compute
        else:
            memory_seconds += memory
    roof_gflops = flops / (compute_seconds + memory_seconds) / 1e9
    gflops = flops / seconds / 1e9
    return RooflinePoint(gflops, read / seconds / 1e9, flops / read,
                         "compute" if compute_seconds >= memory_seconds else "bandwidth",
                         roof_gflops, gflops / roof_gflops, gflops / peak_gflops)
