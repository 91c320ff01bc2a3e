#!/usr/bin/env python
"""What an open web console costs the router.

1. Router CPU: a cluster under a steady light load (--rate mixed requests a second), the router's
   CPU time (user + system, from /proc via psutil) measured over --seconds with no console, then
   with one console subscribed to /console/events (a client reading the stream, as the page
   does), alternating --rounds times; the difference is the console's cost, as a share of one core.
2. The QoS burst (bench/qos_burst.py's workload and cluster, --scale of it, qos policy) run twice
   in the same session: without a console and with one open during the whole burst; High's P99
   TTFT side by side.

    python bench/console_overhead.py [--json PATH] [--seconds 20] [--rounds 3] [--scale 0.3]

Writes router_cpu_pct_without, router_cpu_pct_with, console_cpu_pct_of_core, snapshots_per_s,
snapshot_bytes, high_p99_ttft_ms_without, high_p99_ttft_ms_with, high_p99_ratio.
Targets: console_cpu_pct_of_core < 1; high_p99_ratio within 1.10.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from bench.harness import machine, make_parser, model_or_bench, write_json  # noqa: E402
from bench.loadgen import Front, Job, run_clients  # noqa: E402
from bench.qos_burst import run_policy  # noqa: E402
from bench.qos_workloads import burst_workload  # noqa: E402
from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402


class ConsoleReader(threading.Thread):
    """One console: reads /console/events as the page does, counting snapshots and bytes."""

    def __init__(self, cluster):
        super().__init__(daemon=True)
        self.router = cluster.config.router
        self.snapshots = self.bytes = 0
        self.stopping = False

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.router.host, self.router.http_port, timeout=30)
        conn.request("GET", "/console/events")
        response = conn.getresponse()
        assert response.status == 200, response.status
        while not self.stopping:
            line = response.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                self.snapshots += 1
                self.bytes += len(line)
        conn.close()

    @classmethod
    @contextlib.contextmanager
    def open(cls, cluster):
        reader = cls(cluster)
        reader.start()
        try:
            yield reader
        finally:
            reader.stopping = True
            reader.join(timeout=5)


def steady_jobs(tokenizer, rate: float, seconds: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs, at = [], 0.0
    while at < seconds:
        at += rng.expovariate(rate)
        priority = rng.choice(["high", "medium", "low"])
        jobs.append(Job(priority, "Write one sentence about the sea.", 8, 16, at))
    return jobs


def router_cpu(args, model: str) -> dict:
    config = single_pool(model=model, router=RouterConfig(port=0, http_port=0),
                         scheduler=SchedulerConfig(port=0), workers=[WorkerConfig(port=0, threads=1)])
    tokenizer = TextTokenizer.from_model_dir(model)
    without, with_console, snapshots, size, watched_s = [], [], 0, 0, 0.0
    with LocalCluster(config, quiet=True) as cluster:
        router = psutil.Process(cluster.processes["router"].pid)
        for round_ in range(args.rounds):
            for console in (False, True):
                jobs = steady_jobs(tokenizer, args.rate, args.seconds, args.seed + round_)
                with (ConsoleReader.open(cluster) if console else contextlib.nullcontext()) as reader:
                    time.sleep(1.0)                        # the console connected, its first snapshot sent
                    before, start = router.cpu_times(), time.monotonic()
                    asyncio.run(run_clients(Front.of("grpc", cluster), jobs))
                    time.sleep(max(0.0, args.seconds - (time.monotonic() - start)))
                    after, wall = router.cpu_times(), time.monotonic() - start
                    if reader is not None:
                        snapshots += reader.snapshots
                        size = max(size, reader.bytes // max(1, reader.snapshots))
                        watched_s += wall + 1.0
                used = (after.user - before.user) + (after.system - before.system)
                (with_console if console else without).append(100 * used / wall)
                print(f"round {round_ + 1}: console {'open' if console else 'closed'}: router "
                      f"{100 * used / wall:.2f}% of a core over {wall:.0f} s", file=sys.stderr)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"router_cpu_pct_without": mean(without), "router_cpu_pct_with": mean(with_console),
            "console_cpu_pct_of_core": mean(with_console) - mean(without),
            "snapshots_per_s": snapshots / watched_s, "snapshot_bytes": size}


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=4.0, help="steady requests per second (part 1)")
    parser.add_argument("--scale", type=float, default=0.3, help="of the QoS burst (part 2)")
    parser.add_argument("--skip-burst", action="store_true")
    args = parser.parse_args()
    from services.local.cluster import resolve_model
    result = router_cpu(args, resolve_model("default"))
    if not args.skip_burst:
        model = model_or_bench(None)
        jobs = burst_workload(TextTokenizer.from_model_dir(model), load_model_config(model).max_context,
                              args.scale, 10.0, args.seed, 1.0)
        burst_args = argparse.Namespace(max_step_tokens=128, max_running=32, threads=1, kv_cache_mb=1024, front="grpc")
        plain, _, _ = run_policy("qos", model, jobs, burst_args)
        watched, _, _ = run_policy("qos", model, jobs, burst_args, during=ConsoleReader.open)
        result.update({"high_p99_ttft_ms_without": plain["high_p99_ttft_ms"],
                       "high_p99_ttft_ms_with": watched["high_p99_ttft_ms"]})
        result["high_p99_ratio"] = result["high_p99_ttft_ms_with"] / result["high_p99_ttft_ms_without"]
    print(f"\nrouter CPU, {args.rate:g} requests/s, {args.rounds} x {args.seconds:g} s each way; {machine()}")
    print(f"  console closed: {result['router_cpu_pct_without']:.2f}% of a core")
    print(f"  console open:   {result['router_cpu_pct_with']:.2f}% of a core "
          f"({result['snapshots_per_s']:.2f} snapshots/s, {result['snapshot_bytes']:,} bytes each)")
    print(f"  the console:    {result['console_cpu_pct_of_core']:+.2f}% of a core (target < 1%)")
    if "high_p99_ratio" in result:
        print(f"QoS burst (scale {args.scale:g}), High P99 TTFT: {result['high_p99_ttft_ms_without']:.0f} ms "
              f"without a console, {result['high_p99_ttft_ms_with']:.0f} ms with one: "
              f"{result['high_p99_ratio']:.2f}x (target <= 1.10)")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
