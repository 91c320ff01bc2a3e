#!/usr/bin/env python
"""What bounding oneDNN's primitive caches costs a CPU worker, and what it saves, paired.

oneDNN, and ideep (torch's wrapper around it), cache one compiled primitive per input shape and
weight, 1,024 each by default. An engine step's token count is anything from 1 to its step budget
(decode batches, prefill chunks), so a CPU worker meets hundreds of shapes and its resident
memory grew with each one it met (services/engine/linear.py). This runs the engine alone on
bench/engine_throughput.py's workload (random-token prompts of 16-256 tokens, 16-128 outputs,
32 at a time, a step budget of 128 tokens like the chaos cluster's schedulers) in a fresh process
per run, alternating the capacities asked for (first one first, then reversed, ...), and reports
per capacity: wall time and resident-memory growth over the run, and the paired ratio of wall
time to the first capacity's with a bootstrap 95% interval of its median.

    python bench/onednn_cache.py [--capacities 1024,128] [--pairs 6] [--requests 64] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import machine, make_parser, median_ci, model_or_bench, progress, write_json  # noqa: E402

STEP_TOKENS = 128


def child(capacity: int, model: str, requests: int, seed: int) -> dict:
    """One run in this process: the capacity must be set before the first oneDNN primitive."""
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = os.environ["LRU_CACHE_CAPACITY"] = str(capacity)
    from bench import engine_throughput as et
    from bench.chaos_faults import rss_kib
    from services.common.step import SamplingParams
    from services.engine.batch_runner import BatchRunner, GenerationRequest
    from services.engine.config import load_model_config

    vocab = load_model_config(model).vocab_size
    engine = et.load_engine(model, 1, et.PROMPT_RANGE[1], et.OUTPUT_RANGE[1], "cpu", "fp32")
    runner = BatchRunner(engine, max_running=et.BATCH, max_step_tokens=STEP_TOKENS)

    def run(work):
        return runner.run([GenerationRequest(r.prompt, SamplingParams(temperature=0.0, max_tokens=r.output_len,
                                                                      ignore_eos=True)) for r in work])
    run(et.warmup_workload(seed, vocab))
    before = rss_kib(os.getpid())
    started = time.perf_counter()
    run(et.make_workload(requests, seed, vocab, et.PROMPT_RANGE, et.OUTPUT_RANGE))
    return {"seconds": time.perf_counter() - started, "rss_growth_mb": (rss_kib(os.getpid()) - before) / 1024,
            "rss_mb": rss_kib(os.getpid()) / 1024}


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--capacities", default="1024,128", help="comma-separated; the first is the baseline")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--model", help="model folder (default: the random-weight bench model)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = model_or_bench(args.model)
    if args.child is not None:
        print(json.dumps(child(args.child, model, args.requests, args.seed)))
        return
    capacities = [int(c) for c in args.capacities.split(",")]
    runs: dict[int, list[dict]] = {c: [] for c in capacities}
    with progress(args.pairs * len(capacities), "onednn cache", unit="run") as bar:
        for pair in range(args.pairs):
            for capacity in (capacities if pair % 2 == 0 else capacities[::-1]):
                done = subprocess.run([sys.executable, __file__, "--child", str(capacity), "--model", model,
                                       "--requests", str(args.requests), "--seed", str(args.seed)],
                                      capture_output=True, text=True, check=True)
                runs[capacity].append(json.loads(done.stdout.strip().splitlines()[-1]))
                bar.update()
    base = capacities[0]
    out = {"machine": machine(), "pairs": args.pairs, "requests": args.requests, "step_tokens": STEP_TOKENS,
           "baseline_capacity": base, "capacities": {}}
    print(f"\n{args.pairs} pairs, {args.requests} requests each, 1 thread; {machine()}")
    for capacity in capacities:
        ratio, low, high = median_ci([r["seconds"] / b["seconds"] for r, b in zip(runs[capacity], runs[base])])
        growth = sorted(r["rss_growth_mb"] for r in runs[capacity])
        out["capacities"][str(capacity)] = {
            "seconds": [r["seconds"] for r in runs[capacity]], "rss_growth_mb": [r["rss_growth_mb"] for r in runs[capacity]],
            "rss_mb": [r["rss_mb"] for r in runs[capacity]], "time_ratio_median": ratio, "time_ratio_ci95": [low, high]}
        print(f"  capacity {capacity:>5}: wall {sum(r['seconds'] for r in runs[capacity]) / args.pairs:6.1f} s "
              f"(x{ratio:.3f} of {base}, 95% CI {low:.3f}-{high:.3f}); resident memory +{growth[len(growth) // 2]:.0f} MB "
              f"over the run (median), {max(r['rss_mb'] for r in runs[capacity]):.0f} MB at most")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
