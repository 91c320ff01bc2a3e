#!/usr/bin/env python
"""Discrete-event simulation of a whole qos-serve cluster, to compare routing modes at a scale no
test machine has: the real router (services/router/routing.py, its latency models fed by
simulated pool stats every 200 ms) in front of pools that schedule with the real QoS policy.
Pools run on step-time models of published accelerators (bench/sim/accelerators.py says where
each figure comes from).

Pool models (--pool-model):
  fast  a queueing model of the scheduler (bench/sim/fast_pool.py): decodes counted per class, runs
        of decode-only steps as one event, prefill shares from the real QoSPolicy. The default.
  step  the real ContinuousBatcher plans and postprocesses every step (bench/sim/step_pool.py):
        exact, ~25x slower. --validate runs both on a small cluster and compares them.

Workload: the Azure 2023 conversation (or code) trace, replayed at --rate requests/s (its clock
sped up; it repeats if --duration outlasts it) or as Poisson arrivals at --rate with lengths drawn
from it (--arrivals poisson). Classes by the trace's own lengths (bench/qos_workloads.py
trace_priority): short chat turns High, prompts over 2,048 tokens Low, the rest Medium. SLOs on
time to first token: the router's class defaults (High 200 ms, Medium 2 s, Low 30 s).

Reports, per routing mode (primary: everything on the GPU pools; cost: the overflow rules;
slo-cost: the cheapest pool predicted to meet the SLO): total cost units (tokens x pool price x
class multiplier, as the ledger bills), SLO attainment and P50/P99 TTFT per class, utilisation
and share of requests per device type, the latency model's error, the routing decision's cost.

    python bench/simulate.py [--json PATH] [--fleet h100:8,910b:8,xeon-spr:16] [--rate 60]
                             [--duration 300] [--modes primary,cost,slo-cost] [--trace azure-conv]
                             [--arrivals trace|poisson] [--pool-model fast|step]
    python bench/simulate.py --load-curve 0.25,0.5,1,1.5 --plot sim_cost_vs_slo.png
    python bench/simulate.py --validate        # fast model vs real scheduler, small cluster
                                               # (routing slo-cost, or a single --modes value)
    python bench/simulate.py --replay cost.json [--repeat cost2.json]
                                # predict a real bench/cost_report.py run (bench/sim/replay.py);
                                # --repeat: a second real run of it, the floor of any prediction
    python bench/simulate.py --fleet h100:300,910b:300,xeon-spr:400 --rate 2000 --duration 600 \\
                             --arrivals poisson --modes slo-cost        # scale: 1,000 pools
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import make_parser, write_json  # noqa: E402
from bench.sim.accelerators import ACCELERATORS  # noqa: E402
from bench.sim.cluster import PoolPlan, SimCluster, SimResult  # noqa: E402
from bench.sim.report import CLASSES, headline, plot, table  # noqa: E402
from bench.sim.replay import repeat, replay  # noqa: E402
from bench.sim.workload import poisson, trace_replay  # noqa: E402
from services.router.routing import DEFAULT_COST  # noqa: E402

VALIDATE_FLEET = "h100:1,910b:1,xeon-spr:2"
VALIDATE_TOLERANCE = 0.15


def fleet(text: str) -> list[PoolPlan]:
    """`h100:8,910b:8,xeon-spr:16` -> pools gpu0.., npu0.., cpu0.. at the device's default price."""
    plans, counts = [], {}
    for part in text.split(","):
        name, _, count = part.partition(":")
        if name not in ACCELERATORS:
            raise SystemExit(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}")
        accelerator = ACCELERATORS[name]
        prefix = {"cuda": "gpu", "npu": "npu", "cpu": "cpu"}[accelerator.device]
        for _ in range(int(count or 1)):
            index = counts.get(prefix, 0)
            counts[prefix] = index + 1
            plans.append(PoolPlan(f"{prefix}{index}", accelerator, DEFAULT_COST[accelerator.device]))
    return plans


def arrivals(args, rate: float):
    if args.arrivals == "poisson":
        return poisson(args.trace, rate, args.duration, args.seed)
    return trace_replay(args.trace, rate, args.duration)


def simulate(args, plans: list[PoolPlan], mode: str, rate: float, pool_model: str | None = None) -> SimResult:
    cluster = SimCluster(plans, mode, pool_kind=pool_model or args.pool_model)
    return cluster.run(arrivals(args, rate), args.duration, label=f"{mode} @ {rate:g}/s")


def validate(args) -> dict:
    """The fast model against the real scheduler on a small cluster: P99 TTFT per class."""
    plans = fleet(VALIDATE_FLEET)
    mode = args.modes if "," not in args.modes else "slo-cost"     # one --modes value picks it
    out = {"fleet": VALIDATE_FLEET, "rate": args.rate, "duration_s": args.duration, "mode": mode}
    results = {kind: simulate(args, plans, mode, args.rate, kind) for kind in ("step", "fast")}
    print(f"\nfast model vs real scheduler: {VALIDATE_FLEET}, {args.trace} at {args.rate:g}/s for "
          f"{args.duration:g} s, routing {mode}\n")
    print(table(results))
    print(f"\n{'P99 TTFT':<12}{'step (real)':>14}{'fast model':>14}{'difference':>12}")
    worst = 0.0
    for c in CLASSES:
        step, fast = results["step"].p99_ttft_ms[c], results["fast"].p99_ttft_ms[c]
        diff = fast / step - 1 if step else 0.0
        worst = max(worst, abs(diff))
        print(f"{c:<12}{step:>14,.0f}{fast:>14,.0f}{diff:>+12.1%}")
        out[f"p99_ttft_ms_{c}_step"], out[f"p99_ttft_ms_{c}_fast"] = step, fast
    speedup = results["step"].wall_s / max(results["fast"].wall_s, 1e-9)
    print(f"\nlargest difference {worst:.1%} (tolerance {VALIDATE_TOLERANCE:.0%}): "
          f"{'agree' if worst <= VALIDATE_TOLERANCE else 'DO NOT agree'}; the fast model ran {speedup:.0f}x faster")
    out.update(worst_p99_difference=worst, agree=worst <= VALIDATE_TOLERANCE, speedup=speedup,
               results={k: r.as_dict() for k, r in results.items()})
    return out


def load_curve(args, plans: list[PoolPlan], modes: list[str]) -> dict:
    """Every mode at several loads: cost per request and SLO attainment as load grows."""
    curve = {mode: [] for mode in modes}
    for factor in args.load_curve:
        rate = args.rate * factor
        for mode in modes:
            r = simulate(args, plans, mode, rate)
            curve[mode].append({"load": factor, "rate": rate, "cost_per_request": r.cost_units / max(r.requests, 1),
                                **{f"slo_attainment_{c}": r.slo_attainment[c] for c in CLASSES},
                                **{f"p99_ttft_ms_{c}": r.p99_ttft_ms[c] for c in CLASSES}})
            print(f"load {factor:g} ({rate:g}/s) {mode:>9}: cost/request {curve[mode][-1]['cost_per_request']:,.0f}, "
                  "SLO " + " ".join(f"{c} {r.slo_attainment[c]:.1%}" for c in CLASSES), flush=True)
    return curve


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--fleet", default="h100:8,910b:8,xeon-spr:16",
                        help="accelerator:pools,... (accelerators: " + ", ".join(ACCELERATORS) + ")")
    parser.add_argument("--rate", type=float, default=60.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=300.0, help="simulated seconds of arrivals")
    parser.add_argument("--modes", default="primary,cost,slo-cost")
    parser.add_argument("--trace", default="azure-conv", choices=["azure-conv", "azure-code"])
    parser.add_argument("--arrivals", default="trace", choices=["trace", "poisson"])
    parser.add_argument("--pool-model", default="fast", choices=["fast", "step"])
    parser.add_argument("--validate", action="store_true", help="fast model vs real scheduler, small cluster")
    parser.add_argument("--load-curve", type=lambda s: [float(x) for x in s.split(",")],
                        help="run every mode at these multiples of --rate")
    parser.add_argument("--replay", type=Path, metavar="COST_JSON",
                        help="predict the real run a bench/cost_report.py --json file describes")
    parser.add_argument("--repeat", type=Path, metavar="COST_JSON",
                        help="with --replay: a second real run of the same workload, compared with the first")
    parser.add_argument("--plot", type=Path, help="PNG of cost and SLO attainment vs load (with --load-curve)")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.validate:
        write_json(args.json, validate(args))
        return
    if args.replay:
        result = replay(args.replay)
        if args.repeat:
            result["repeat"] = repeat(args.replay, args.repeat)
        write_json(args.json, result)
        return
    plans = fleet(args.fleet)
    modes = args.modes.split(",")
    describe = (f"{args.fleet} ({len(plans)} pools), {args.trace} {args.arrivals} at {args.rate:g} req/s for "
                f"{args.duration:g} s, pool model {args.pool_model}")
    if args.load_curve:
        curve = load_curve(args, plans, modes)
        if args.plot:
            plot(curve, args.plot, describe)
        write_json(args.json, {"fleet": args.fleet, "trace": args.trace, "rate": args.rate,
                               "duration_s": args.duration, "curve": curve})
        return
    results = {mode: simulate(args, plans, mode, args.rate) for mode in modes}
    print(f"\n{describe}\n")
    print(table(results))
    if "primary" in results and "slo-cost" in results:
        a, b = results["primary"], results["slo-cost"]
        print(f"\nslo-cost vs primary: {1 - b.cost_units / a.cost_units:.1%} fewer cost units; SLO attainment "
              + ", ".join(f"{c} {100 * (b.slo_attainment[c] - a.slo_attainment[c]):+.2f} points" for c in CLASSES))
    print(f"simulated in {time.perf_counter() - started:.0f} s")
    write_json(args.json, {"fleet": args.fleet, "pools": len(plans), "trace": args.trace,
                           "arrivals": args.arrivals, "rate": args.rate, "duration_s": args.duration,
                           "pool_model": args.pool_model, **headline(results),
                           "results": {m: r.as_dict() for m, r in results.items()}})


if __name__ == "__main__":
    main()
