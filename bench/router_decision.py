#!/usr/bin/env python
"""Time the router's pool decision: 100,000 decisions over 8 pools, from cached load only, for
the rules (`cost`) and for predicted latency (`slo-cost`; target p99 <= 10 us).

Pools: 2 GPU, 3 NPU (one with LoRA), 3 CPU, all serving the model; loads randomised (seeded) so
every rule is exercised: High, LoRA, under and over the overflow threshold, SLO misses; each
load carries a stats report (step time, queues by class) for the latency model.

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
from services.router.latency_model import PoolReport  # noqa: E402
from services.router.routing import (PoolLoad, PoolRouter, PoolSpec,  # noqa: E402
                                     RouteRequest)

MODEL = "smollm2"


def report(rng: random.Random, previous: PoolReport | None, device: str) -> PoolReport:
    """The next cumulative stats report of a pool: a few steps more, a random queue."""
    fixed, per_token = {"cuda": (5.0, 0.02), "npu": (15.0, 0.08), "cpu": (60.0, 1.0)}[device]
    steps = rng.randint(1, 10)
    tokens = rng.randint(8, 256)
    base = previous or PoolReport()
    waiting = tuple(rng.randint(0, 6) for _ in range(3))
    return PoolReport(step_seconds=base.step_seconds + steps * (fixed + per_token * tokens) / 1000,
                      worker_steps=base.worker_steps + steps, step_tokens=base.step_tokens + steps * tokens,
                      steps=base.steps + steps, waiting=waiting, at_s=base.at_s + 0.2,
                      finished=base.finished + rng.randint(0, 3), kv_capacity=100_000,
                      kv_tokens=rng.randint(0, 80_000), kv_by_class=(10_000, 30_000, 20_000),
                      kv_caps=(1.0, 0.7, 0.3),
                      waiting_tokens=tuple(n * rng.randint(50, 500) for n in waiting),
                      running=tuple(rng.randint(0, 16) for _ in range(3)), max_step_tokens=256, max_running=32)


def time_decisions(mode: str, pools: list[PoolSpec], requests: list[RouteRequest], loads: list[dict],
                   decisions: int) -> tuple[float, float, dict[str, int]]:
    router = PoolRouter(pools, mode=mode)
    timings_ns = []
    rules: dict[str, int] = {}
    clock = time.perf_counter_ns
    for i in range(decisions):
        if i % 1000 == 0:                    # new cached stats now and then, as the streams deliver
            for name, load in loads[(i // 1000) % len(loads)].items():
                router.update(name, load)
        request = requests[i % len(requests)]
        started = clock()
        decision = router.route(request)
        timings_ns.append(clock() - started)
        rules[decision.rule] = rules.get(decision.rule, 0) + 1
    return quantile(timings_ns, 0.5) / 1000, quantile(timings_ns, 0.99) / 1000, rules


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--decisions", type=int, default=100_000)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    models = frozenset({MODEL})
    pools = ([PoolSpec(f"gpu{i}", "cuda", models) for i in range(2)]
             + [PoolSpec(f"npu{i}", "npu", models, lora=i == 0) for i in range(3)]
             + [PoolSpec(f"cpu{i}", "cpu", models) for i in range(3)])
    requests = [RouteRequest(MODEL, rng.choice([HIGH, MEDIUM, LOW, LOW]),
                             lora="adapter" if rng.random() < 0.1 else None,
                             slo_ms=rng.choice([None, 500.0, 5_000.0]), prompt_tokens=rng.randint(20, 2000))
                for _ in range(1000)]
    # GPU queues often past the overflow threshold, so that every rule fires; the LoRA pool holds
    # the adapter the LoRA requests name, as its stats stream reports it.
    reports: dict[str, PoolReport | None] = {p.name: None for p in pools}
    loads = []
    for _ in range(100):
        round_ = {}
        for p in pools:
            reports[p.name] = report(rng, reports[p.name], p.device)
            round_[p.name] = PoolLoad(healthy=True, queued=rng.randint(0, 40 if p.device == "cuda" else 8),
                                      free_kv=rng.random(), ttft_ms=rng.uniform(50, 3000),
                                      utilization=rng.random(),
                                      adapters=frozenset({"adapter"}) if p.lora else frozenset(),
                                      report=reports[p.name])
        loads.append(round_)

    results = {mode: time_decisions(mode, pools, requests, loads, args.decisions) for mode in ("cost", "slo-cost")}
    loop_ns = python_loop_ns()
    print(f"{args.decisions} decisions over {len(pools)} pools on {machine(cpu=False)}")
    for mode, (p50, p99, rules) in results.items():
        target = 5 if mode == "cost" else 10
        print(f"{mode:>9}: p50 {p50:.2f} us, p99 {p99:.2f} us (target p99 <= {target} us); rules taken: "
              + ", ".join(f"{k} {v}" for k, v in sorted(rules.items())))
    print(calibration_line(loop_ns))
    (p50, p99, rules), (slo_p50, slo_p99, slo_rules) = results["cost"], results["slo-cost"]
    write_json(args.json, {"decision_p50_us": p50, "decision_p99_us": p99, "decisions": args.decisions,
                           "pools": len(pools), "rules": rules, "python_loop_ns": loop_ns,
                           "slo_cost_decision_p50_us": slo_p50, "slo_cost_decision_p99_us": slo_p99,
                           "slo_cost_rules": slo_rules})


if __name__ == "__main__":
    main()
