#!/usr/bin/env python
"""Cost report: one workload on the same two-pool cluster layout, once per routing mode, side by side.

Modes (router.routing): "primary" (everything on the primary pool), "cost" (the overflow rules:
Low and Medium go to the cheaper pool when the primary queues), "slo-cost" (the cheapest pool
whose predicted time to first token meets the request's SLO; services/router/latency_model.py).
Same requests, same arrival times, same seed, same model, same machine. Prints total cost units,
SLO attainment (TTFT within the class default: High 200 ms, Medium 2 s, Low 30 s) and P99
latencies per class for each mode.

Pools (both CPU, on this machine): "primary" (cost 1.0 per token, like a GPU pool's price) and
"cheap" (cost 0.1, like a CPU pool). Workload: --requests requests arriving as a Poisson stream
at --rate per second, 2 in 10 High chat, 3 Medium, 5 Low.

While each run goes, the pools' stats are polled every 200 ms and fed to the router's own
latency model (services/router/latency_model.py, its samples not faded, so the fit is the whole
run's). The JSON holds that step-time fit per pool, the pools' step counters over time (the
machine's pace, bench/sim/pace.py), the router's margins over time (from its /metrics) and every
request's arrival, class, lengths, pool and TTFT:
what `bench/simulate.py --replay PATH` needs to predict this very run (the simulator
is checked against reality).

    python bench/cost_report.py [--json PATH] [--requests N] [--rate R] [--seed S]
                                [--modes primary,cost,slo-cost]
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.harness import PRIORITIES, make_parser, progress, quantile, write_json  # noqa: E402
from services.common.config import ClusterConfig, PoolConfig, RouterConfig, SchedulerConfig, WorkerConfig  # noqa: E402
from services.common.priority import parse_priority  # noqa: E402
from services.common.proto.qos.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from services.control.limits import estimated_prompt_tokens  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402
from services.router.latency_model import LatencyModel, StepFit  # noqa: E402
from services.router.pools import pool_load  # noqa: E402
from services.router.routing import DEFAULT_SLO_MS  # noqa: E402
from services.tools.client import RouterClient, chat_request, sampling_params  # noqa: E402

MAX_TOKENS = {"high": 16, "medium": 24, "low": 32}
TOPICS = ["rivers", "volcanoes", "trains", "bees", "clouds", "chess", "bridges", "tea", "maps", "owls"]
POOLS = {"primary": 1.0, "cheap": 0.1}           # name -> cost per token
MAX_RUNNING, MAX_STEP_TOKENS = 4, 64
STATS_INTERVAL_S = 0.2
MARGIN_EVERY = 5                   # the router's margins every 5th poll (1 s)


def cluster_config(routing: str) -> ClusterConfig:
    def pool(name, cost, primary):
        return PoolConfig(name=name, device="cpu", cost_per_token=cost, primary=primary,
                          scheduler=SchedulerConfig(port=0, max_running=MAX_RUNNING, max_step_tokens=MAX_STEP_TOKENS),
                          workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=64)])
    return ClusterConfig(router=RouterConfig(port=0, http_port=0, routing=routing),
                         pools=[pool(name, cost, name == "primary") for name, cost in POOLS.items()])


def workload(count: int, rate: float, seed: int) -> list[tuple[float, str, str]]:
    """(arrival offset s, priority, prompt) of each request."""
    rng = random.Random(seed)
    mix = ["high"] * 2 + ["medium"] * 3 + ["low"] * 5
    at, out = 0.0, []
    for _ in range(count):
        out.append((at, rng.choice(mix), f"Write two sentences about {rng.choice(TOPICS)}."))
        at += rng.expovariate(rate)
    return out


async def run_workload(address: str, requests, bar, started: float) -> list[dict]:
    async with RouterClient(address) as client:
        async def one(at, priority, prompt):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - started)))
            params = sampling_params(max_tokens=MAX_TOKENS[priority], temperature=0.0, ignore_eos=True)
            request = chat_request(prompt, params)
            try:
                answer = await client.generate(request, priority=priority)
                return {"priority": priority, "arrival_s": at, "ok": True, "pool": answer.pool,
                        "cost": answer.cost_units, "ttft_ms": answer.ttft_ms, "e2e_ms": answer.e2e_ms,
                        # the scheduler's own: from arrival there (tokenized) to the first token
                        "scheduler_ttft_ms": answer.server_timings.ttft_ms if answer.server_timings else None,
                        # ... of which queued: until a step (or a cut-in) first computed it
                        "scheduler_queue_ms": answer.server_timings.queue_ms if answer.server_timings else None,
                        "prompt_tokens": answer.total_tokens - len(answer.token_ids),
                        # of which the prefix cache served (not computed, billed at a discount)
                        "cached_tokens": answer.cached_tokens,
                        # what the router routed by: its estimate from the text (limits.py)
                        "routed_prompt_tokens": estimated_prompt_tokens(request),
                        "output_tokens": len(answer.token_ids)}
            except grpc.aio.AioRpcError as exc:
                return {"priority": priority, "arrival_s": at, "ok": False, "error": exc.code().name}
            finally:
                bar.update()
        return await asyncio.gather(*(one(*r) for r in requests))


def margins_from_metrics(text: str) -> dict[str, float]:
    """qos_route_prediction_margin{pool=...} from a Prometheus text page: the factor the router
    multiplies each pool's predictions by."""
    margins = {}
    for line in text.splitlines():
        if line.startswith("qos_route_prediction_margin{"):
            labels, value = line.rsplit(" ", 1)
            margins[labels.split('pool="', 1)[1].split('"', 1)[0]] = float(value)
    return margins


def router_margins(cluster: LocalCluster) -> dict[str, float]:
    """The real router's margins now, from its /metrics."""
    router = cluster.config.router
    with urllib.request.urlopen(f"http://{router.host}:{router.http_port}/metrics", timeout=2) as answer:
        return margins_from_metrics(answer.read().decode())


async def watch_pools(cluster: LocalCluster, models: dict[str, LatencyModel], kv_tokens: dict[str, int],
                      samples: dict[str, list], margins: list, started: float, stop: asyncio.Event) -> None:
    """Each pool's stats every STATS_INTERVAL_S into a latency model, as the router does; its KV
    capacity; its cumulative step counters with the time since the workload started (what
    bench/sim/pace.py turns into the machine's pace over the run); and every MARGIN_EVERY polls
    the router's margins."""
    trust = cluster.trust
    channels = {p.name: trust.channel(p.scheduler.address, "scheduler") for p in cluster.config.pools}
    polls = 0
    try:
        while not stop.is_set():
            polls += 1
            if polls % MARGIN_EVERY == 0:
                margins.append([round(time.perf_counter() - started, 3),
                                await asyncio.to_thread(router_margins, cluster)])
            for name, channel in channels.items():
                stats = await scheduler_pb2_grpc.SchedulerStub(channel).GetPoolStats(scheduler_pb2.PoolStatsRequest(),
                                                                                     metadata=trust.metadata)
                load = pool_load(stats)
                samples[name].append([round(time.perf_counter() - started, 3), stats.step_seconds, stats.worker_steps,
                                      stats.step_tokens, stats.step_kv_tokens, stats.cut_ins])
                if load.report is not None:
                    models[name].report(load.report)
                    kv_tokens[name] = stats.kv_blocks_total * stats.block_size
            try:
                await asyncio.wait_for(stop.wait(), STATS_INTERVAL_S)
            except asyncio.TimeoutError:
                pass
    finally:
        for channel in channels.values():
            await channel.close()


def step_fits(models: dict[str, LatencyModel], kv_tokens: dict[str, int]) -> dict:
    fits = {}
    for name, model in models.items():
        if not model.known:
            continue
        model.fit.solve()
        fits[name] = {"fixed_ms": model.fit.fixed_ms, "ms_per_token": model.fit.ms_per_token,
                      "ms_per_kv_token": model.fit.ms_per_kv_token,
                      "kv_tokens": kv_tokens.get(name, 0)}
    return fits


def run_mode(mode: str, requests) -> dict:
    # Unfaded: the fit of the whole run (the router's own fades, to follow changes).
    models = {name: LatencyModel(fit=StepFit(fade=1.0)) for name in POOLS}
    kv_tokens: dict[str, int] = {}
    samples: dict[str, list] = {name: [] for name in POOLS}
    margins: list = []
    with LocalCluster(cluster_config(mode), quiet=True) as cluster:
        async def go():
            stop = asyncio.Event()
            started = time.perf_counter()
            watcher = asyncio.create_task(watch_pools(cluster, models, kv_tokens, samples, margins, started, stop))
            with progress(len(requests), f"routing={mode}") as bar:
                results = await run_workload(cluster.router_address, requests, bar, started)
            stop.set()
            await watcher
            return results
        started = time.perf_counter()
        results = asyncio.run(go())
        wall = time.perf_counter() - started
    summary = summarise(results)
    summary.update(wall_s=wall, requests=results, step_fits=step_fits(models, kv_tokens), pace_samples=samples,
                   router_margins=margins)
    return summary


def summarise(results: list[dict]) -> dict:
    ok = [r for r in results if r["ok"]]
    summary = {"total_cost_units": sum(r["cost"] for r in ok), "failed": len(results) - len(ok),
               "pools": {name: sum(1 for r in ok if r["pool"] == name) for name in POOLS}}
    for priority in PRIORITIES:
        mine = [r for r in results if r["priority"] == priority]
        slo = DEFAULT_SLO_MS[parse_priority(priority)]
        met = sum(1 for r in mine if r["ok"] and r["ttft_ms"] <= slo)
        summary[f"{priority}_slo_attainment"] = met / max(len(mine), 1)
        done = [r for r in mine if r["ok"]]
        summary[f"{priority}_p99_ttft_ms"] = quantile([r["ttft_ms"] for r in done], 0.99)
        summary[f"{priority}_p99_e2e_ms"] = quantile([r["e2e_ms"] for r in done], 0.99)
    return summary


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--rate", type=float, default=1.0, help="arrivals per second (Poisson)")
    parser.add_argument("--modes", default="primary,cost,slo-cost")
    args = parser.parse_args()
    requests = workload(args.requests, args.rate, args.seed)
    modes = args.modes.split(",")
    report = {}
    for mode in modes:
        print(f"starting a two-pool cluster, routing={mode}...", file=sys.stderr, flush=True)
        report[mode] = run_mode(mode, requests)
    counts = {p: sum(1 for _, q, _ in requests if q == p) for p in PRIORITIES}
    print(f"\n{len(requests)} requests (seed {args.seed}; {counts['high']} high, {counts['medium']} medium, "
          f"{counts['low']} low), Poisson at {args.rate:g}/s, SmolLM2-135M on this machine's CPU; pools "
          "primary (cost 1.0) and cheap (cost 0.1)\n")
    print(f"{'':<26}" + "".join(f"{m:>14}" for m in modes))

    def row(label, key, fmt):
        print(f"{label:<26}" + "".join(f"{format(report[m][key], fmt):>14}" for m in modes))

    row("total cost units", "total_cost_units", ",.0f")
    for priority in PRIORITIES:
        row(f"{priority} SLO attainment", f"{priority}_slo_attainment", ".0%")
    for priority in PRIORITIES:
        row(f"{priority} P99 TTFT ms", f"{priority}_p99_ttft_ms", ",.0f")
    for priority in PRIORITIES:
        row(f"{priority} P99 end-to-end ms", f"{priority}_p99_e2e_ms", ",.0f")
    print(f"{'served by primary/cheap':<26}" + "".join(
        f"{str(report[m]['pools']['primary']) + '/' + str(report[m]['pools']['cheap']):>14}" for m in modes))
    row("failed", "failed", "d")
    if "primary" in report:
        base = report["primary"]["total_cost_units"]
        print("\ncost vs primary: " + ", ".join(f"{m} {report[m]['total_cost_units'] / base - 1:+.0%}"
                                                for m in modes if m != "primary"))
    if "cost" in report and "slo-cost" in report:
        a, b = report["cost"], report["slo-cost"]
        print(f"slo-cost vs cost: {b['total_cost_units'] / a['total_cost_units'] - 1:+.0%} cost units; SLO "
              "attainment " + ", ".join(f"{p} {100 * (b[f'{p}_slo_attainment'] - a[f'{p}_slo_attainment']):+.0f} points"
                                        for p in PRIORITIES))
    write_json(args.json, {"modes": report, "seed": args.seed, "rate": args.rate, "requests": len(requests),
                           "pools": POOLS, "primary": "primary", "max_running": MAX_RUNNING,
                           "max_step_tokens": MAX_STEP_TOKENS})


if __name__ == "__main__":
    main()
