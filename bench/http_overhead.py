#!/usr/bin/env python
"""What the HTTP front costs: the same mixed load through the router's gRPC and through its
OpenAI-compatible HTTP front (Server-Sent Events), on one cluster, in one run, side by side.

Load: --requests (32) requests, priorities in turn high / medium / low, prompts of 16-256 tokens
of ordinary words, 16 output tokens each (greedy, ignore_eos), SmolLM2-135M on one CPU worker,
in two phases: paced (Poisson arrivals at --rate per second: the server is busy but not queued
for long, so a TTFT is mostly the serving path, where a front's cost shows; TTFT is taken from
this phase) and burst (all at once: the server saturated; tokens/s is taken from this phase). Each priority is sent by its own client process (bench/loadgen.py; for HTTP the lean
SSE client of bench/http_client.py). In each phase the fronts take turns for --rounds rounds each
(gRPC, HTTP, gRPC, HTTP, ...), so drift in the machine's speed hits both alike; figures pool each
front's rounds. Targets: HTTP TTFT P50 within 10% (or 5 ms) of gRPC's, tokens/s within 5%.

    python bench/http_overhead.py [--json PATH] [--requests N] [--rate R] [--rounds N] [--seed S]
"""
from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import PRIORITIES, machine, make_parser, progress, quantile, write_json  # noqa: E402
from bench.loadgen import Front, Job, run_clients  # noqa: E402
from bench.qos_workloads import text_of_tokens  # noqa: E402
from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402

OUTPUT_TOKENS = 16
FRONTS = ("grpc", "http")


def workload(tokenizer: TextTokenizer, count: int, rate: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs, at = [], 0.0
    for i in range(count):
        text, n = text_of_tokens(tokenizer, rng, rng.randint(16, 256))
        jobs.append(Job(PRIORITIES[i % 3], text, n, OUTPUT_TOKENS, at))
        at += rng.expovariate(rate) if rate > 0 else 0.0
    return jobs


def one_round(cluster: LocalCluster, front: str, jobs: list[Job], label: str):
    with progress(len(jobs), label) as bar:
        outcomes, start = asyncio.run(run_clients(Front.of(front, cluster), jobs, on_progress=bar.update))
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise SystemExit(f"{label}: {len(failed)} requests failed, e.g. {failed[0].code}: {failed[0].detail}")
    return outcomes, max(o.done_at for o in outcomes)


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1.0, help="arrivals per second (0: all at once)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per front, taking turns")
    args = parser.parse_args()
    config = single_pool(router=RouterConfig(port=0, http_port=0),
                         scheduler=SchedulerConfig(port=0, max_step_tokens=128),
                         workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=256)])
    results = {(phase, front): {"outcomes": [], "wall_s": 0.0}
               for phase in ("paced", "burst") for front in FRONTS}
    with LocalCluster(config, quiet=True) as cluster:
        tokenizer = TextTokenizer.from_model_dir(cluster.config.model)
        phases = {"paced": workload(tokenizer, args.requests, args.rate, args.seed),
                  "burst": workload(tokenizer, args.requests, 0.0, args.seed)}
        one_round(cluster, "grpc", phases["burst"], "warm-up")
        for phase, jobs in phases.items():
            for i in range(args.rounds):
                for front in FRONTS:
                    outcomes, wall = one_round(cluster, front, jobs, f"{phase} {front} {i + 1}")
                    results[phase, front]["outcomes"] += outcomes
                    results[phase, front]["wall_s"] += wall

    figures = {}
    for front in FRONTS:
        paced, burst = results["paced", front], results["burst", front]
        ttft = [o.ttft_ms for o in paced["outcomes"]]
        figures[front] = {"ttft_p50_ms": quantile(ttft, 0.5), "ttft_p99_ms": quantile(ttft, 0.99),
                          "tok_s": sum(o.tokens for o in burst["outcomes"]) / burst["wall_s"]}
    g, h = figures["grpc"], figures["http"]
    ttft_ok = h["ttft_p50_ms"] <= max(g["ttft_p50_ms"] * 1.10, g["ttft_p50_ms"] + 5)
    tok_ok = h["tok_s"] >= 0.95 * g["tok_s"]
    print(f"\n{args.requests} requests (TTFT paced at {args.rate:g}/s, tokens/s all at once) x "
          f"{args.rounds} rounds per front and phase (seed {args.seed}), SmolLM2-135M, one CPU worker "
          f"(1 thread); {machine()}\n")
    print(f"{'':<16}{'gRPC':>10}{'HTTP+SSE':>10}{'HTTP/gRPC':>11}")
    for key, label in (("ttft_p50_ms", "TTFT P50 (ms)"), ("ttft_p99_ms", "TTFT P99 (ms)"),
                       ("tok_s", "tokens/s")):
        print(f"{label:<16}{g[key]:>10.1f}{h[key]:>10.1f}{h[key] / g[key]:>10.3f}x")
    print(f"TTFT P50 target (within 10% or 5 ms): {'met' if ttft_ok else 'NOT met'}; "
          f"tokens/s target (within 5%): {'met' if tok_ok else 'NOT met'}")
    write_json(args.json, {
        "grpc_ttft_p50_ms": g["ttft_p50_ms"], "http_ttft_p50_ms": h["ttft_p50_ms"],
        "grpc_ttft_p99_ms": g["ttft_p99_ms"], "http_ttft_p99_ms": h["ttft_p99_ms"],
        "grpc_tok_s": g["tok_s"], "http_tok_s": h["tok_s"], "requests": args.requests,
        "rate": args.rate, "rounds": args.rounds, "ttft_target_met": ttft_ok, "tok_s_target_met": tok_ok})


if __name__ == "__main__":
    main()
