#!/usr/bin/env python
"""Cost report: one workload, two runs on the same two-pool cluster layout, side by side.

Run A sends everything to the primary pool (router.routing = "primary"); run B routes cost-aware
(router.routing = "cost": Low and Medium overflow to the cheaper pool when the primary queues).
Same requests, same seed, same model, same machine. Prints total cost units and per-priority
P99 latency for both, with the saving and the latency price.

Pools (both CPU, on this machine): "primary" (cost 1.0 per token, like a GPU pool's price) and
"cheap" (cost 0.1, like a CPU pool). Workload: a burst of High chat, Medium and Low requests.

    python bench/cost_report.py [--json PATH] [--requests N] [--seed S]
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.harness import PRIORITIES, make_parser, progress, quantile, write_json  # noqa: E402
from services.client import RouterClient, chat_request, sampling_params  # noqa: E402
from services.cluster import LocalCluster  # noqa: E402
from services.common.config import (ClusterConfig, PoolConfig, RouterConfig,  # noqa: E402
                                    SchedulerConfig, WorkerConfig)

MAX_TOKENS = {"high": 16, "medium": 24, "low": 32}
TOPICS = ["rivers", "volcanoes", "trains", "bees", "clouds", "chess", "bridges", "tea", "maps", "owls"]


def cluster_config(routing: str) -> ClusterConfig:
    def pool(name, cost, primary):
        return PoolConfig(name=name, device="cpu", cost_per_token=cost, primary=primary,
                          scheduler=SchedulerConfig(port=0, max_running=4, max_step_tokens=64),
                          workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=64)])
    return ClusterConfig(router=RouterConfig(port=0, http_port=0, routing=routing),
                         pools=[pool("primary", 1.0, True), pool("cheap", 0.1, False)])


def workload(count: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    mix = ["high"] * 2 + ["medium"] * 3 + ["low"] * 5
    return [(rng.choice(mix), f"Write two sentences about {rng.choice(TOPICS)}.") for _ in range(count)]


async def run_workload(address: str, requests, bar) -> list[dict]:
    async with RouterClient(address) as client:
        async def one(priority, prompt):
            params = sampling_params(max_tokens=MAX_TOKENS[priority], temperature=0.0, ignore_eos=True)
            try:
                answer = await client.generate(chat_request(prompt, params), priority=priority)
                return {"priority": priority, "ok": True, "pool": answer.pool, "cost": answer.cost_units,
                        "ttft_ms": answer.ttft_ms, "e2e_ms": answer.e2e_ms}
            except grpc.aio.AioRpcError as exc:
                return {"priority": priority, "ok": False, "error": exc.code().name}
            finally:
                bar.update()
        return await asyncio.gather(*(one(p, t) for p, t in requests))


def summarise(results: list[dict]) -> dict:
    ok = [r for r in results if r["ok"]]
    summary = {"total_cost_units": sum(r["cost"] for r in ok), "failed": len(results) - len(ok),
               "pools": {name: sum(1 for r in ok if r["pool"] == name) for name in ("primary", "cheap")}}
    for priority in PRIORITIES:
        mine = [r for r in ok if r["priority"] == priority]
        summary[f"{priority}_p99_ttft_ms"] = quantile([r["ttft_ms"] for r in mine], 0.99)
        summary[f"{priority}_p99_e2e_ms"] = quantile([r["e2e_ms"] for r in mine], 0.99)
    return summary


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    requests = workload(args.requests, args.seed)
    report = {}
    for mode in ("primary", "cost"):
        print(f"starting a two-pool cluster, routing={mode}...", file=sys.stderr, flush=True)
        with LocalCluster(cluster_config(mode), quiet=True) as cluster:
            with progress(len(requests), f"routing={mode}") as bar:
                started = time.perf_counter()
                results = asyncio.run(run_workload(cluster.router_address, requests, bar))
            report[mode] = summarise(results)
            report[mode]["wall_s"] = time.perf_counter() - started
    a, b = report["primary"], report["cost"]
    print(f"\n{len(requests)} requests (seed {args.seed}; {sum(1 for p, _ in requests if p == 'high')} high, "
          f"{sum(1 for p, _ in requests if p == 'medium')} medium, {sum(1 for p, _ in requests if p == 'low')} low), "
          "SmolLM2-135M on this machine's CPU; pools primary (cost 1.0) and cheap (cost 0.1)\n")
    print(f"{'':<24}{'all on primary':>16}{'cost-aware':>14}{'change':>12}")
    saving = 1 - b["total_cost_units"] / a["total_cost_units"]
    print(f"{'total cost units':<24}{a['total_cost_units']:>16.0f}{b['total_cost_units']:>14.0f}{-saving:>+12.0%}")
    for priority in PRIORITIES:
        for kind in ("ttft", "e2e"):
            key = f"{priority}_p99_{kind}_ms"
            print(f"{priority + ' P99 ' + kind.upper() + ' ms':<24}{a[key]:>16.0f}{b[key]:>14.0f}"
                  f"{b[key] / a[key] - 1:>+12.0%}")
    print(f"{'served by primary/cheap':<24}{a['pools']['primary']:>10}/{a['pools']['cheap']:<5}"
          f"{b['pools']['primary']:>8}/{b['pools']['cheap']:<5}")
    print(f"{'failed':<24}{a['failed']:>16}{b['failed']:>14}")
    print(f"\ncost saving {saving:.0%}; latency price: High P99 TTFT "
          f"{b['high_p99_ttft_ms'] / a['high_p99_ttft_ms'] - 1:+.0%}, Low P99 end-to-end "
          f"{b['low_p99_e2e_ms'] / a['low_p99_e2e_ms'] - 1:+.0%}")
    write_json(args.json, {"primary_only": a, "cost_aware": b, "saving": saving,
                           "requests": len(requests), "seed": args.seed})


if __name__ == "__main__":
    main()
