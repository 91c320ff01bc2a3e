#!/usr/bin/env python
"""The cost simulator against six real runs: does it predict what a real cluster does?

Six real runs of bench/cost_report.py on this machine (two CPU pools, SmolLM2-135M; different
loads and routing modes, so different pool mixes: everything on the primary pool, the overflow
rules, SLO-and-cost routing), one routing mode each, every run's JSON kept under --runs. Each is
then predicted by the simulator (bench/sim/replay.py: the real router and scheduler over pools
whose steps take the run's measured step-time fit at the machine's measured pace) and compared:
total cost units and High and Medium P99 TTFT. A comparison passes with cost within 10% and both
P99s within 20%; the target is at least 5 of the 6. Next to each real P99, the interval it would
move within from sampling alone (the floor of any prediction).

    python bench/simulator_validation.py --json bench/results/simulator_validation.json
    python bench/simulator_validation.py --json ... --replay-only     # the runs kept, predicted again
    python bench/simulator_validation.py --repeat                     # the first run once more: the
                                       # floor of any prediction (two real runs of one workload)
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import make_parser, write_json  # noqa: E402
from bench.sim.replay import repeat, replay  # noqa: E402

RUNS_DIR = Path(__file__).resolve().parent / "results" / "simulator_runs"
# (name, arrivals a second, routing mode, requests, seed): light to heavy load, each pool mix; four
# minutes each, so that each class's P99 is over 50-180 requests rather than its one or two worst.
RUNS = [("primary-1.0", 1.0, "primary", 240, 11), ("cost-0.75", 0.75, "cost", 200, 12),
        ("cost-1.25", 1.25, "cost", 300, 13), ("cost-1.5", 1.5, "cost", 360, 14),
        ("slo-cost-1.0", 1.0, "slo-cost", 240, 15), ("slo-cost-1.5", 1.5, "slo-cost", 360, 16)]
COST_TOLERANCE, P99_TOLERANCE = 0.10, 0.20


def run_real(name: str, rate: float, mode: str, requests: int, seed: int, runs: Path) -> Path:
    path = runs / f"{name}.json"
    print(f"real run {name}: {requests} requests at {rate:g}/s, routing {mode}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "cost_report.py"), "--requests",
                    str(requests), "--rate", str(rate), "--modes", mode, "--seed", str(seed), "--json", str(path)],
                   check=True)
    return path


def comparison(name: str, rate: float, mode: str, path: Path) -> dict:
    predicted = replay(path)[mode]

    def err(label: str) -> float:
        return predicted[label]["simulated"]["difference"]

    row = {"run": name, "rate": rate, "mode": mode, "source": str(path.relative_to(RUNS_DIR.parent.parent.parent)),
           "cost_err": err("cost units"), "high_p99_err": err("high P99 TTFT ms"),
           "medium_p99_err": err("medium P99 TTFT ms"), "low_p99_err": err("low P99 TTFT ms")}
    for c in ("high", "medium"):
        cell = predicted[f"{c} P99 TTFT ms"]
        row[f"{c}_p99_real_ms"] = cell["real"]
        row[f"{c}_p99_simulated_ms"] = cell["simulated"]["predicted"]
        row[f"{c}_p99_real_resampled_90"] = cell["real_resampled_90"]
        # the pools' model alone: each request sent where the real router sent it
        row[f"{c}_p99_err_real_routes"] = cell["real routes"]["difference"]
    # Where a P99 misses: its first-token step (P50 computing, real and simulated); each pool's steps.
    for c in ("high", "medium", "low"):
        cell = predicted.get(f"{c} P50 computing ms")
        if cell is not None:
            row[f"{c}_p50_computing_ms"] = [cell["real"], cell["simulated"]["predicted"]]
    row["pools"] = predicted["pools"]
    row["cost_real"] = predicted["cost units"]["real"]
    row["cost_simulated"] = predicted["cost units"]["simulated"]["predicted"]
    row["pass"] = (abs(row["cost_err"]) <= COST_TOLERANCE and abs(row["high_p99_err"]) <= P99_TOLERANCE
                   and abs(row["medium_p99_err"]) <= P99_TOLERANCE)
    return row


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--runs", type=Path, default=RUNS_DIR, help="folder of the real runs' JSON")
    parser.add_argument("--replay-only", action="store_true", help="predict the runs already in --runs")
    parser.add_argument("--only", help="comma-separated run names (default: all six)")
    parser.add_argument("--repeat", action="store_true",
                        help="run the first run's workload again and compare the two real runs")
    args = parser.parse_args()
    if args.repeat:
        name, rate, mode, requests, seed = RUNS[0]
        again = run_real(f"{name}-again", rate, mode, requests, seed, args.runs)
        write_json(args.json, repeat(args.runs / f"{name}.json", again))
        return
    args.runs.mkdir(parents=True, exist_ok=True)
    chosen = [r for r in RUNS if not args.only or r[0] in args.only.split(",")]
    rows = []
    for name, rate, mode, requests, seed in chosen:
        path = args.runs / f"{name}.json"
        if not args.replay_only:
            path = run_real(name, rate, mode, requests, seed, args.runs)
        rows.append(comparison(name, rate, mode, path))
    print(f"\n{'run':<15}{'cost':>8}{'High P99':>10}{'Medium P99':>12}   High P99 real / sim (ms)   pass")
    for r in rows:
        print(f"{r['run']:<15}{r['cost_err']:>+8.0%}{r['high_p99_err']:>+10.0%}{r['medium_p99_err']:>+12.0%}"
              f"   {r['high_p99_real_ms']:>9,.0f} / {r['high_p99_simulated_ms']:<9,.0f}    {'yes' if r['pass'] else 'no'}")
    passed = sum(r["pass"] for r in rows)
    print(f"\n{passed} of {len(rows)} within cost {COST_TOLERANCE:.0%} and High/Medium P99 {P99_TOLERANCE:.0%} "
          f"(target: 5 of 6)")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
