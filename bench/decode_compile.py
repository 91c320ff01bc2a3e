#!/usr/bin/env python
"""torch.compile (inductor, CPU) of a batch-1 decode step's small ops, against eager.

Between its linear layers and attention (C kernels called through ctypes, which a compiled
graph can only break around), a decode step of SmolLM2-135M runs about 30 small ops a layer on
one row: the two RMSNorms (eight ops each in bf16), the rotary embedding, the residual adds and
silu(gate) * up. Those are what a compiled step would fuse. This measures each chain eager and
compiled (dynamic=False: one graph for the one-row shape), per call, in alternating rounds, with
the compile time and whether the compiled chain gives the eager bits.

    python bench/decode_compile.py [--dtype bf16] [--rounds 6] [--calls 3000] [--json PATH]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.harness import cpu_name, make_parser, write_json  # noqa: E402
from services.engine.device import set_cpu_threads  # noqa: E402
from services.engine.rope import apply_rotary  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, EPS = 576, 1536, 9, 3, 64, 1e-5   # SmolLM2-135M


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The engine's bf16 RMSNorm (services/engine/model.py: the reference's form)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * x32.to(x.dtype)


def rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return apply_rotary(qk, cos, sin)


def mlp_mix(x: torch.Tensor, gate_up: torch.Tensor, down_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = gate_up.chunk(2, dim=-1)
    return x + down_out, F.silu(gate).mul_(up)


def chains(dtype: torch.dtype) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, HIDDEN, generator=g).to(dtype)
    return {
        "rms_norm": (rms_norm, (x, torch.rand(HIDDEN, generator=g).to(dtype))),
        "rotary": (rotary, (torch.randn(1, HEADS + KV_HEADS, HEAD_DIM, generator=g).to(dtype),
                            torch.rand(1, 1, HEAD_DIM, generator=g).to(dtype),
                            torch.rand(1, 1, HEAD_DIM, generator=g).to(dtype))),
        "residual + silu * up": (mlp_mix, (x, torch.randn(1, 2 * INTERMEDIATE, generator=g).to(dtype),
                                           torch.randn(1, HIDDEN, generator=g).to(dtype))),
    }


def per_call_us(fn, args, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - started) / calls * 1e6


def same(a, b) -> bool:
    pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
    return all(torch.equal(x, y) for x, y in pairs)


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    threads = set_cpu_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    report = {"cpu": cpu_name(), "threads": threads, "dtype": args.dtype, "torch": torch.__version__,
              "rounds": args.rounds, "calls": args.calls, "chains": {}}
    with torch.inference_mode():
        for name, (fn, inputs) in chains(dtype).items():
            started = time.perf_counter()
            compiled = torch.compile(fn, dynamic=False)
            compiled(*inputs)
            compile_s = time.perf_counter() - started
            for call in (fn, compiled):                    # warm both
                per_call_us(call, inputs, 200)
            eager, fused = [], []
            for round_ in range(args.rounds):              # alternate which goes first
                order = ((eager, fn), (fused, compiled)) if round_ % 2 == 0 else ((fused, compiled), (eager, fn))
                for times, call in order:
                    times.append(per_call_us(call, inputs, args.calls))
            ratios = [e / c for e, c in zip(eager, fused)]
            row = {"compile_s": compile_s, "eager_us": statistics.median(eager),
                   "compiled_us": statistics.median(fused), "eager_over_compiled": statistics.median(ratios),
                   "ratios": ratios, "same_bits": same(fn(*inputs), compiled(*inputs))}
            report["chains"][name] = row
            print(f"{name:22} eager {row['eager_us']:6.1f} us  compiled {row['compiled_us']:6.1f} us  "
                  f"eager/compiled {row['eager_over_compiled']:.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f})  "
                  f"compile {compile_s:.1f} s  same bits {row['same_bits']}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
