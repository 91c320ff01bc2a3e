#!/usr/bin/env python
"""How long a local cluster takes to start (router, scheduler, one CPU worker, as the e2e tests
start them), with the readiness polls' channels reconnecting fast (on: services/common/grpc_server.py
POLL_OPTIONS) against gRPC's default reconnect backoff (off: 1 s after a refused connection, then
1.6, 2.6 s...), alternating which goes first; mean ratio on / off with a 95% t interval.

    python bench/cluster_start.py --pairs 8 --json bench/results/cluster_start.json [--model default]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import services.common.grpc_server as grpc_server  # noqa: E402
from bench.engine_paired import mean_interval  # noqa: E402
from bench.harness import make_parser, model_or_bench, write_json  # noqa: E402
from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402

FAST = list(grpc_server.POLL_OPTIONS)


def cluster_config(model: str):
    """One pool, one CPU worker of 1 thread and a 256 MiB KV cache, free ports: as the e2e tests
    start their clusters."""
    return single_pool(router=RouterConfig(port=0, http_port=0), scheduler=SchedulerConfig(port=0),
                       workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=256)], model=model)


def start_seconds(model: str, fast: bool) -> float:
    grpc_server.POLL_OPTIONS = FAST if fast else []      # read by wait_healthy at each call
    started = time.perf_counter()
    with LocalCluster(cluster_config(model), quiet=True):
        return time.perf_counter() - started


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--model", default="default", help='"default" (SmolLM2-135M) or "bench"')
    args = parser.parse_args()
    model = "default" if args.model == "default" else model_or_bench(None)
    pairs = []
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        seconds = {("on" if fast else "off"): start_seconds(model, fast) for fast in order}
        pairs.append({**seconds, "ratio": seconds["on"] / seconds["off"], "on_first": order[0]})
        print(f"pair {pair + 1}/{args.pairs}: on {seconds['on']:.2f} s, off {seconds['off']:.2f} s", flush=True)
    mean, low, high = mean_interval([p["ratio"] for p in pairs])
    print(f"start time on / off: {mean:.3f} [{low:.3f}, {high:.3f}] over {args.pairs} pairs")
    write_json(args.json, {"model": args.model, "pairs": pairs, "mean_ratio": mean, "interval95": [low, high]})


if __name__ == "__main__":
    main()
