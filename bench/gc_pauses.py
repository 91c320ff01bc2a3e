#!/usr/bin/env python
"""Garbage-collection pauses in the router, the scheduler and the worker under a burst, with the
startup heap frozen out of the collector's scans (the default, services/common/gc_pauses.py)
against left in them (QOS_GC_FREEZE=0), in the same run.

Each round starts a local cluster (router, scheduler, one worker on the bench model, 1 thread) in
each mode, alternately, sends it --batches batches of --requests concurrent Medium requests (200-
character prompts, --tokens output tokens, a chunk per token), then reads every service's
qos_gc_pause_seconds histogram from its /metrics: collections per generation, their total time,
and the mean pause of a full (generation-2) collection. A pause holds the whole process, the GIL
included: every stream of that service waits for it.

    python bench/gc_pauses.py [--rounds 2] [--batches 3] [--requests 300] [--tokens 16] [--json PATH]
"""
from __future__ import annotations

import asyncio
import os
import statistics
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.control_plane_cpu import send_batch  # noqa: E402
from bench.harness import calibration_line, machine, make_parser, model_or_bench, python_loop_ns, write_json  # noqa: E402
from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool  # noqa: E402
from services.common.gc_pauses import FREEZE_ENV, GENERATIONS  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402

SERVICES = ("router", "scheduler", "worker")
MODES = {"unfrozen": "0", "frozen": "1"}


def gc_figures(host: str, port: int) -> dict:
    """{generation: (collections, seconds)} and the frozen objects, from a service's /metrics."""
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    counts, seconds, frozen = {}, {}, 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "qos_gc_pause_seconds_count":
                counts[int(sample.labels["generation"])] = sample.value
            elif sample.name == "qos_gc_pause_seconds_sum":
                seconds[int(sample.labels["generation"])] = sample.value
            elif sample.name == "qos_gc_frozen_objects":
                frozen = sample.value
    return {"collections": {g: counts.get(g, 0) for g in GENERATIONS},
            "seconds": {g: seconds.get(g, 0.0) for g in GENERATIONS}, "frozen_objects": frozen}


def measure(mode: str, model: str, batches: int, requests: int, tokens: int) -> dict:
    """One cluster in `mode`: every service's GC figures over the load (minus those of startup)."""
    os.environ[FREEZE_ENV] = MODES[mode]         # the cluster's processes inherit it
    config = single_pool(router=RouterConfig(port=0, http_port=-1, metrics_port=0),
                         scheduler=SchedulerConfig(port=0, metrics_port=0),
                         workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=256, metrics_port=0)], model=model)
    with LocalCluster(config, quiet=True) as cluster:
        sections = {"router": config.router, "scheduler": config.pools[0].scheduler,
                    "worker": config.pools[0].workers[0]}
        asyncio.run(send_batch(cluster.router_address, 20, 2))        # warm, and every service serving
        before = {name: gc_figures(s.host, s.metrics_port) for name, s in sections.items()}
        for _ in range(batches):
            asyncio.run(send_batch(cluster.router_address, requests, tokens))
        after = {name: gc_figures(s.host, s.metrics_port) for name, s in sections.items()}
    figures = {}
    for name in SERVICES:
        b, a = before[name], after[name]
        figures[name] = {"collections": {g: a["collections"][g] - b["collections"][g] for g in GENERATIONS},
                         "seconds": {g: a["seconds"][g] - b["seconds"][g] for g in GENERATIONS},
                         "frozen_objects": a["frozen_objects"]}
    return figures


def summary(runs: list[dict], service: str) -> dict:
    """Over the rounds of one mode: full collections, their mean pause, all GC time per 1,000 requests."""
    full = sum(r[service]["collections"][2] for r in runs)
    full_s = sum(r[service]["seconds"][2] for r in runs)
    total_s = sum(sum(r[service]["seconds"].values()) for r in runs)
    return {"full_collections": full, "full_pause_mean_ms": full_s / full * 1000 if full else 0.0,
            "young_collections": sum(r[service]["collections"][0] + r[service]["collections"][1] for r in runs),
            "gc_seconds": total_s, "frozen_objects": statistics.median(r[service]["frozen_objects"] for r in runs)}


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="clusters of each mode, alternately")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300, help="concurrent requests a batch")
    parser.add_argument("--tokens", type=int, default=16, help="output tokens a request")
    parser.add_argument("--model", default=None, help="model folder or 'default' (default: the bench model)")
    args = parser.parse_args()
    if min(args.rounds, args.batches, args.requests, args.tokens) < 1:
        parser.error("--rounds, --batches, --requests and --tokens must be >= 1")
    model = model_or_bench(args.model)
    runs = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES:
            print(f"round {round_ + 1}/{args.rounds}: {mode} ...", file=sys.stderr, flush=True)
            runs[mode].append(measure(mode, model, args.batches, args.requests, args.tokens))
    sent = args.rounds * args.batches * args.requests
    loop_ns = python_loop_ns()
    print(f"{machine(cpu=False)}; {sent} requests a mode ({args.rounds} clusters x {args.batches} batches of "
          f"{args.requests} concurrent, {args.tokens} tokens each)")
    print(calibration_line(loop_ns))
    print("| service | figure | startup heap unfrozen | frozen | frozen / unfrozen |")
    print("|---|---|---|---|---|")
    report = {}
    for service in SERVICES:
        unfrozen, frozen = summary(runs["unfrozen"], service), summary(runs["frozen"], service)
        report[service] = {"unfrozen": unfrozen, "frozen": frozen}
        rows = (("full (gen-2) collections", "full_collections", "{:.0f}"),
                ("mean full-collection pause, ms", "full_pause_mean_ms", "{:.2f}"),
                ("young (gen-0/1) collections", "young_collections", "{:.0f}"),
                ("all GC time per 1,000 requests, ms", None, "{:.1f}"),
                ("objects frozen at startup", "frozen_objects", "{:.0f}"))
        for label, key, form in rows:
            a = unfrozen[key] if key else unfrozen["gc_seconds"] / sent * 1e6
            b = frozen[key] if key else frozen["gc_seconds"] / sent * 1e6
            ratio = f"{b / a:.2f}x" if a and key != "frozen_objects" else "-"
            print(f"| {service} | {label} | {form.format(a)} | {form.format(b)} | {ratio} |")
    write_json(args.json, {"requests_per_mode": sent, "rounds": args.rounds, "batches": args.batches,
                           "requests": args.requests, "tokens": args.tokens, "python_loop_ns": loop_ns,
                           "services": report, "runs": runs})


if __name__ == "__main__":
    main()
