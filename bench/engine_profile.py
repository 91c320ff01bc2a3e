#!/usr/bin/env python
"""Where the engine's time goes on bench/engine_throughput.py's batch-32 workload, by kind of step.

The engine alone (no transformers) runs the b32 phase (same requests, same BatchRunner settings).
Steps are split into those that carry prompt chunks and decode-only ones; every `--every`-th
step of the kind asked for runs under torch.profiler, and the report gives, per profiled step,
its wall time, the torch operators' self time (the largest first) and what is left outside them
(the C kernels, called through ctypes, and Python), next to the unprofiled steps' mean
wall time, since the profiler slows what it watches. Matmul GFLOPS are estimated from
the model's shapes: 2 x (layer parameters x tokens + output-head parameters x sampled rows).

    python bench/engine_profile.py [--kind prompt|decode] [--every 3] [--threads 2] [--dtype float32] [--json PATH]
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.engine_workload import (BATCH, OUTPUT_RANGE, PROMPT_RANGE, load_engine, make_workload,  # noqa: E402
                                   run_engine, warmup_workload)
from bench.harness import make_parser, write_json  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.engine.default_model import default_model_dir  # noqa: E402
from services.engine.device import set_cpu_threads  # noqa: E402

TOP_OPS = 12


def layer_and_head_params(model) -> tuple[int, int]:
    """Matmul parameters per token in the decoder layers, and in the output head (per sampled
    row), read off the loaded model's linear layers."""
    layers = sum(linear.in_features * linear.out_features for layer in model.layers
                 for linear in (layer.qkv, layer.out, layer.gate_up, layer.down))
    # The output head is kept in pieces of the vocabulary (model.py: LOGITS_PIECE_BYTES).
    return layers, sum(piece.in_features * piece.out_features for piece in model.lm_head)


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--kind", choices=["prompt", "decode"], default="decode")
    parser.add_argument("--every", type=int, default=3, help="profile every N-th step of that kind")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    if args.every < 1 or args.requests < 1 or args.threads < 0:
        parser.error("need --every >= 1, --requests >= 1 and --threads >= 0 (0: all cores)")

    threads = set_cpu_threads(args.threads)
    model_dir = str(default_model_dir())
    config = load_model_config(model_dir)
    workload = make_workload(args.requests, args.seed, config.vocab_size, PROMPT_RANGE, OUTPUT_RANGE)
    engine = load_engine(model_dir, threads, PROMPT_RANGE[1], OUTPUT_RANGE[1], "cpu", args.dtype)
    run_engine(engine, warmup_workload(args.seed, config.vocab_size), 2)
    layer_params, head_params = layer_and_head_params(engine.model)

    plain_step = engine.step
    wall_ms, steps, op_ms, profiled = Counter(), Counter(), Counter(), {"steps": 0, "wall_ms": 0.0, "flops": 0.0}

    def step(batch):
        kind = "prompt" if any(len(s.token_ids) > 1 for s in batch.sequences) else "decode"
        watch = kind == args.kind and steps[kind] % args.every == 0
        steps[kind] += 1
        if not watch:
            started = time.perf_counter()
            output = plain_step(batch)
            wall_ms[kind] += (time.perf_counter() - started) * 1000
            return output
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()     # the profiler's own start and stop left out
            output = plain_step(batch)
            profiled["wall_ms"] += (time.perf_counter() - started) * 1000
        for event in prof.key_averages():
            op_ms[event.key] += event.self_cpu_time_total / 1000
        profiled["steps"] += 1
        profiled["flops"] += 2 * (layer_params * batch.num_tokens + head_params * len(output.tokens))
        return output

    engine.step = step
    seconds, _ = run_engine(engine, workload, BATCH)
    n = max(profiled["steps"], 1)
    ops_total = sum(op_ms.values()) / n
    matmul = op_ms.get("mkldnn::_linear_pointwise", 0.0) + op_ms.get("aten::addmm", 0.0) + op_ms.get("aten::mm", 0.0)
    # Where the linear layers run on the engine's C kernel (or a decode step's layers in one C
    # call), the profiler sees no matmul operator: GFLOPS then over the profiled steps' wall time.
    torch_matmuls = matmul > 0.01 * profiled["wall_ms"]
    gflops = profiled["flops"] / (matmul if torch_matmuls else max(profiled["wall_ms"], 1e-9)) / 1e6
    plain = {k: steps[k] - (profiled["steps"] if k == args.kind else 0) for k in ("prompt", "decode")}
    print(f"b32 phase, engine alone ({threads} threads): {seconds:.1f} s with the profiling; steps not "
          "profiled: " + "; ".join(f"{plain[k]} {k}, {wall_ms[k] / max(plain[k], 1):.1f} ms each"
                                   for k in ("prompt", "decode")))
    print(f"\n{args.kind} steps profiled: {profiled['steps']}, {profiled['wall_ms'] / n:.1f} ms each; "
          f"torch operators {ops_total:.1f} ms, outside them (C kernels, Python) "
          f"{profiled['wall_ms'] / n - ops_total:.1f} ms; matmul FLOPs ~{gflops:.0f} GFLOPS "
          + ("of the matmul operators' time" if torch_matmuls else "of the steps' wall time (matmuls in C kernels)"))
    for name, total in op_ms.most_common(TOP_OPS):
        print(f"  {name:<52}{total / n:>9.1f} ms")
    write_json(args.json, {"seconds": seconds, "steps": dict(steps),
                           "unprofiled_step_ms": {k: wall_ms[k] / max(plain[k], 1) for k in plain},
                           "kind": args.kind, "profiled_steps": profiled["steps"],
                           "profiled_step_ms": profiled["wall_ms"] / n,
                           "ops_ms_per_step": {k: v / n for k, v in op_ms.items()},
                           "matmul_gflops": gflops, "gflops_over": "matmul operators" if torch_matmuls else "wall time",
                           "threads": threads})


if __name__ == "__main__":
    main()
