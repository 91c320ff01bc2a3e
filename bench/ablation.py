#!/usr/bin/env python
"""Does each latency mechanism earn its place? Paired on/off runs of the burst's flood.

For every mechanism below, the QoS cluster runs the same flood with the mechanism on and with it
off, alternating (on-off, then off-on, ...), each run on a fresh cluster. A run is the burst of
bench/qos_burst.py at full scale (800 Medium and Low requests in its first second) with only the
High requests sent in its first --window seconds; it measures each of those High requests' time to
first token at the client, and Low's throughput as the tokens the scheduler computed for Low
(prefill and decode) from the flood's start to --low-seconds later. The flood's clients are then
killed (their requests cancelled) and the cluster stopped.

For each mechanism and each of High's P50, P90 and P99 TTFT and Low's tok/s, a pair gives the
ratio on / off; the report is the median paired ratio with a bootstrap 95% interval (pairs
resampled). A mechanism is kept where High's P90 interval lies wholly below 1 (on is faster
beyond the run-to-run spread) and Low's interval does not lie wholly below 0.9; otherwise the
verdict is `remove`, unless it serves a purpose other than High's figure (`purpose`, in the JSON).

    python bench/ablation.py [--pairs 6] [--only cut_in,first_token_hold] [--json PATH] [--resume]

With --resume, the mechanisms that --json already holds with --pairs pairs are kept (their
verdicts made again), and only the others are run.

Other options are bench/qos_burst.py's (--model, --seed, --max-running, ...). The JSON is
rewritten after every pair, so a long run that is stopped keeps what it measured. It may not be
bench/results/ablation_measured.json, the committed run of fifteen mechanisms (docs/performance.md's
table): the four below would replace it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench.harness import (calibration_line, machine, median_ci, model_or_bench, python_loop_ns,  # noqa: E402
                           quantile, write_json)
from bench.loadgen import Front, Job, run_clients  # noqa: E402
from bench.qos_burst import cluster_config, parse_args  # noqa: E402
from bench.qos_workloads import burst_workload  # noqa: E402
from services.common.priority import LOW  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402

WARMUP_PROBES = 3           # High requests sent alone before the flood: the cluster's first calls
LOW_FLOOR = 0.9             # a mechanism that surely costs Low more than this share of its tok/s is not kept
MEASURED = Path(__file__).resolve().parent / "results" / "ablation_measured.json"


@dataclass(frozen=True)
class Mechanism:
    name: str
    what: str
    on: Callable          # (ClusterConfig) -> None: set the mechanism on
    off: Callable         # ... and off
    purpose: str = ""     # a purpose other than High's latency figure, if it has one


def _sched(**values) -> Callable:
    def apply(config):
        for key, value in values.items():
            setattr(config.pools[0].scheduler, key, value)
    return apply


def _router(**values) -> Callable:
    def apply(config):
        for key, value in values.items():
            setattr(config.router, key, value)
    return apply


# The mechanisms the product has now, each with its switch. Those removed after the committed run
# (bench/results/ablation_measured.json, at the commit it names) were switched the same way: the first-token
# modes, the first-token hold, the router's High lane, tokenizer thread nice values, tokenizing
# short Medium and Low prompts on the loop, the router's nice value, short steps, the forward
# window and CPU binding.
MECHANISMS = [
    Mechanism("cut_in", "High cut-ins: a new High request's first step runs inside the worker's step in flight",
              _sched(high_cut_in=True), _sched(high_cut_in=False)),
    Mechanism("cut_in_slots", "running slots beyond max_running for cut-ins (a quarter) vs none",
              _sched(high_cut_in_slots=0.25), _sched(high_cut_in_slots=0.0),
              purpose="restored after the paired burst comparison (docs/performance.md): without them "
                      "High's P99 TTFT over a whole burst was about 1.9x"),
    Mechanism("router_intake", "the router's priority intake (High admitted first through a burst) vs arrival order",
              _router(admission="priority"), _router(admission="fifo"),
              purpose="the router's half of the priority path: without it a flood's calls are validated "
                      "and forwarded in arrival order, High behind them"),
    Mechanism("stream_intervals", "Medium and Low stream a chunk per 4 and 16 tokens vs one per token",
              _sched(stream_intervals=[1, 4, 16]), _sched(stream_intervals=[1, 1, 1]),
              purpose="fewer messages per token through scheduler, router and client (vLLM's stream "
                      "interval): CPU per streamed token, whatever High's figure"),
]


async def _low_served(cluster: LocalCluster) -> int:
    stats = await cluster.pool_stats()
    return next(c.served_tokens for c in stats.classes if c.priority == LOW)


async def _flood(front: Front, cluster: LocalCluster, jobs: list[Job], low_seconds: float) -> tuple[list, float]:
    """Send the flood and the window's High requests; (High outcomes, Low tok/s over low_seconds)."""
    before = await _low_served(cluster)
    started = time.time()
    outcomes, _ = await run_clients(front, jobs, until_done={"high"})
    await asyncio.sleep(max(0.0, started + low_seconds - time.time()))
    after = await _low_served(cluster)
    return outcomes, (after - before) / (time.time() - started)


def one_run(mechanism: Mechanism, on: bool, model: str, flood: list[Job], probes: list[Job], args) -> dict:
    config = cluster_config("qos", model, args)
    (mechanism.on if on else mechanism.off)(config)
    with LocalCluster(config, quiet=True) as cluster:
        front = Front.of("grpc", cluster)
        asyncio.run(run_clients(front, probes))
        outcomes, low_tok_s = asyncio.run(_flood(front, cluster, flood, args.low_seconds))
        for process in cluster.processes.values():      # the flood's requests are not waited for
            process.kill()
    ttft = [o.ttft_ms for o in outcomes if o.ok]
    return {"on": on, "high_requests": len(ttft), "high_failed": sum(not o.ok for o in outcomes),
            "high_p50_ttft_ms": quantile(ttft, 0.5), "high_p90_ttft_ms": quantile(ttft, 0.9),
            "high_p99_ttft_ms": quantile(ttft, 0.99), "low_tok_s": low_tok_s}


def verdict(name: str, what: str, purpose: str, pairs: list[tuple[dict, dict]]) -> dict:
    """The row of one mechanism: each figure's median paired ratio (on / off) with its 95%
    interval, and whether it stays: where High's P90 interval lies below 1 and Low's does not lie
    below LOW_FLOOR, or where it has a purpose other than these figures. (The rule was fixed
    before the runs; Low's tok/s is a veto, not a reason to keep.)"""
    row: dict = {"name": name, "what": what, "pairs": len(pairs)}
    for figure, key in [("p50", "high_p50_ttft_ms"), ("p90", "high_p90_ttft_ms"), ("p99", "high_p99_ttft_ms"),
                        ("low_tok_s", "low_tok_s")]:
        ratio, low, high = median_ci([on[key] / off[key] if off[key] else math.nan for on, off in pairs])
        row[f"{figure}_ratio"], row[f"{figure}_ci_low"], row[f"{figure}_ci_high"] = ratio, low, high
    faster = row["p90_ci_high"] < 1.0
    costs_low = row["low_tok_s_ci_high"] < LOW_FLOOR      # Low surely loses more than 10%
    row["verdict"] = "keep" if (faster and not costs_low) or purpose else "remove"
    row["reason"] = ("P90 interval below 1, Low not surely below 0.9x" if faster and not costs_low else
                     f"purpose: {purpose}" if purpose else
                     "faster, but Low's interval lies below 0.9x" if faster else
                     "P90 interval above 1 (slower with it)" if row["p90_ci_low"] > 1.0 else
                     "P90 interval includes 1 (no effect beyond the spread)")
    return row


def pairs_of(runs: list[dict]) -> list[tuple[dict, dict]]:
    """The (on, off) pairs of a mechanism's runs, which alternate on-off, off-on, ..."""
    return [(a, b) if a["on"] else (b, a) for a, b in zip(runs[::2], runs[1::2])]


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def main() -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--pairs", type=int, default=6, help="on/off pairs per mechanism")
    own.add_argument("--only", default="", help="comma-separated mechanism names (default: all)")
    own.add_argument("--window", type=float, default=3.0, help="High requests sent in this many s of the flood")
    own.add_argument("--low-seconds", type=float, default=10.0, help="Low tok/s over this many s from the start")
    own.add_argument("--resume", action="store_true",
                     help="keep the mechanisms already measured in --json with --pairs pairs; run the rest")
    if "-h" in sys.argv or "--help" in sys.argv:
        print(__doc__)
        own.print_help()
        print("mechanisms: " + ", ".join(m.name for m in MECHANISMS))
        return
    mine, rest = own.parse_known_args()
    args = parse_args(rest + ["--policies", "qos"])
    if args.json and args.json.resolve() == MEASURED:
        sys.exit(f"{MEASURED.name} holds the committed run of fifteen mechanisms: --json elsewhere "
                 "(e.g. bench/results/ablation_current.json)")
    for key, value in vars(mine).items():
        setattr(args, key, value)
    chosen = [m for m in MECHANISMS if not args.only or m.name in args.only.split(",")]
    model = model_or_bench(args.model)
    jobs = burst_workload(TextTokenizer.from_model_dir(model), load_model_config(model).max_context,
                          1.0, args.high_rate, args.seed, args.flood_seconds)
    flood = [j for j in jobs if j.priority != "high" or j.at < args.window]
    high = [j for j in jobs if j.priority == "high"]
    probes = [Job("high", j.prompt, j.prompt_tokens, max_tokens=1, at=i * 0.3)
              for i, j in enumerate(high[:WARMUP_PROBES])]
    loop_ns = python_loop_ns()
    report = {"machine": machine(), "commit": git_commit(), "python_loop_ns": loop_ns,
              "workload": f"burst flood at full scale, High sent in its first {args.window:g} s "
                          f"({sum(j.priority == 'high' for j in flood)} requests), "
                          f"Low tok/s over {args.low_seconds:g} s",
              "mechanisms": [], "runs": {}}
    if args.resume and args.json and args.json.exists():
        previous = json.loads(args.json.read_text())
        report["mechanisms"] = [r for r in previous["mechanisms"] if r["pairs"] >= args.pairs]
        report["runs"] = {r["name"]: previous["runs"][r["name"]] for r in report["mechanisms"]}
        report["earlier"] = {key: previous[key] for key in ("commit", "python_loop_ns", "workload")}
    print(machine(), file=sys.stderr)
    print(calibration_line(loop_ns), file=sys.stderr)
    for mechanism in chosen:
        if mechanism.name in report["runs"]:
            continue
        pairs = []
        report["runs"][mechanism.name] = runs = []
        for index in range(args.pairs):
            order = (True, False) if index % 2 == 0 else (False, True)
            result = {on: one_run(mechanism, on, model, flood, probes, args) for on in order}
            pairs.append((result[True], result[False]))
            runs.extend(result[on] for on in order)
            print(f"{mechanism.name} pair {index + 1}: P90 on {result[True]['high_p90_ttft_ms']:.1f} / off "
                  f"{result[False]['high_p90_ttft_ms']:.1f} ms, Low on {result[True]['low_tok_s']:.0f} / off "
                  f"{result[False]['low_tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
            row = verdict(mechanism.name, mechanism.what, mechanism.purpose, pairs)
            report["mechanisms"] = [r for r in report["mechanisms"] if r["name"] != mechanism.name] + [row]
            write_json(args.json, report)
    # Verdicts of the mechanisms kept from an earlier run are made again by today's rule.
    purposes = {m.name: m.purpose for m in MECHANISMS}
    report["mechanisms"] = [verdict(r["name"], r["what"], purposes.get(r["name"], ""),
                                    pairs_of(report["runs"][r["name"]])) for r in report["mechanisms"]]
    write_json(args.json, report)
    print("\n| mechanism | pairs | High P50 on/off | P90 on/off [95% CI] | P99 on/off | Low tok/s on/off | verdict |")
    print("|---|---|---|---|---|---|---|")
    for r in report["mechanisms"]:
        print(f"| {r['name']} | {r['pairs']} | {r['p50_ratio']:.2f} | {r['p90_ratio']:.2f} "
              f"[{r['p90_ci_low']:.2f}, {r['p90_ci_high']:.2f}] | {r['p99_ratio']:.2f} | {r['low_tok_s_ratio']:.2f} "
              f"| {r['verdict']} |")


if __name__ == "__main__":
    main()
