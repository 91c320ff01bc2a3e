#!/usr/bin/env python
"""Time the router's pool decision: 100,000 decisions over 8 pools, from cached load only.

Pools: 2 GPU, 3 NPU (one with LoRA), 3 CPU, all serving the model; loads randomised (seeded) so
every rule is exercised: High, LoRA, under and over the overflow threshold, SLO misses.

    python bench/router_decision.py [--json PATH] [--decisions N] [--seed S]

Beside the result: python_loop_ns, the calibration figure of bench/harness.py, from this run.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import calibration_line, machine, make_parser, python_loop_ns, quantile, write_json  # noqa: E402
from services.common.priority import HIGH, LOW, MEDIUM  # noqa: E402
from services.router.routing import (PoolLoad, PoolRouter, PoolSpec,  # noqa: E402
                                     RouteRequest)

MODEL = "smollm2"


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--decisions", type=int, default=100_000)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    models = frozenset({MODEL})
    pools = ([PoolSpec(f"gpu{i}", "cuda", models) for i in range(2)]
             + [PoolSpec(f"npu{i}", "npu", models, lora=i == 0) for i in range(3)]
             + [PoolSpec(f"cpu{i}", "cpu", models) for i in range(3)])
    router = PoolRouter(pools)
    requests = [RouteRequest(MODEL, rng.choice([HIGH, MEDIUM, LOW, LOW]),
                             lora="adapter" if rng.random() < 0.1 else None,
                             slo_ms=rng.choice([None, 500.0, 5_000.0])) for _ in range(1000)]
    # GPU queues often past the overflow threshold, so that every rule fires; the LoRA pool holds
    # the adapter the LoRA requests name, as its stats stream reports it.
    loads = [{p.name: PoolLoad(healthy=True, queued=rng.randint(0, 40 if p.device == "cuda" else 8), free_kv=rng.random(),
                               ttft_ms=rng.uniform(50, 3000), utilization=rng.random(),
                               adapters=frozenset({"adapter"}) if p.lora else frozenset())
              for p in pools} for _ in range(100)]

    timings_ns = []
    rules: dict[str, int] = {}
    clock = time.perf_counter_ns
    for i in range(args.decisions):
        if i % 1000 == 0:                    # new cached stats now and then, as the streams deliver
            for name, load in loads[(i // 1000) % len(loads)].items():
                router.update(name, load)
        request = requests[i % len(requests)]
        started = clock()
        decision = router.route(request)
        timings_ns.append(clock() - started)
        rules[decision.rule] = rules.get(decision.rule, 0) + 1
    p50, p99 = quantile(timings_ns, 0.5) / 1000, quantile(timings_ns, 0.99) / 1000
    loop_ns = python_loop_ns()
    print(f"{args.decisions} decisions over {len(pools)} pools on {machine(cpu=False)}")
    print(f"decision: p50 {p50:.2f} us, p99 {p99:.2f} us (target p99 <= 5 us)")
    print(calibration_line(loop_ns))
    print("rules taken: " + ", ".join(f"{k} {v}" for k, v in sorted(rules.items())))
    write_json(args.json, {"decision_p50_us": p50, "decision_p99_us": p99, "decisions": args.decisions,
                           "pools": len(pools), "rules": rules, "python_loop_ns": loop_ns})


if __name__ == "__main__":
    main()
