#!/usr/bin/env python
"""The QoS benchmark: the same burst, first-come-first-served and then QoS, side by side.

For each policy the driver starts a local cluster itself (router, scheduler, one CPU worker as
separate processes), sends the workload through the router (over gRPC, or with --front http
through its OpenAI-compatible HTTP front as Server-Sent Events), samples the pool's stats while
it runs, and stops the cluster. Same requests, same seed, same model, same machine.

Workload `burst` (default; counts scale with --scale):
  Low    300 requests, the longest prompts the model allows (>= 8x Medium), 128 output tokens
  Medium 500 requests, ~256-token prompts, 64 output tokens
  High   200 requests, ~32-token prompts, 32 output tokens
Low and Medium flood in at uniform random times within the first --flood-seconds (1 s: 800
requests a second; 0: all at the same instant); High arrives as a Poisson stream (--high-rate
per second) during the flood. Output lengths are fixed (ignore_eos). Each priority is sent by its
own client process (bench/loadgen.py); Low's and Medium's at a lower CPU priority than the
services under test (High's few requests at theirs: a niced client read its chunks late).
The FCFS run is priority-blind end to end (FCFS scheduler policy, FIFO admission at the router).

Workload `steady` (--workload steady): first the cluster's capacity for the mix (High 0.3,
Medium 0.5, Low 0.2 of the requests, the burst's shapes) is measured in the same run, as the
requests per second a FCFS cluster completes of a saturating batch (--capacity-requests sent at
once); then every class arrives as a Poisson stream for --duration seconds (300) at --load (0.85)
of that capacity, for each policy.

Before every workload, 12 High requests of the workload's own prompt lengths (one output token
each, 0.75 s apart) measure High's idle TTFT on the same cluster; the report gives High's P99
TTFT under load over that idle P50 (high_p99_ttft_over_idle), and recompute_share, the tokens
preempted sequences had computed (to be computed again) over all tokens computed. High's TTFT is
also split per request into wait (arrival at the scheduler to its first step), step (then to its
first token leaving the scheduler) and rest (client, router, hops): each part's P99 under load
(high_p99_ttft_parts_ms) beside its P50 over the idle probes (idle_high_p50_ttft_parts_ms).

Trace replay (`--trace azure-code` or `azure-conv`, from bench/traces/, Azure 2023, CC-BY 4.0):
the first --trace-requests rows after --trace-skip, arrival gaps divided by --time-scale, input
and output lengths multiplied by --length-scale and capped to fit the model's context. Priority
rule, from what each request looks like: output <= 64 tokens and input <= 1,024 tokens -> High
(interactive, short), input > 2,048 tokens -> Low (long-context, batch-like), else Medium.

    python bench/qos_burst.py [--scale 0.2] [--json out.json] [--plots DIR] [--model DIR]
    python bench/qos_burst.py --trace azure-code [--trace-requests 300] [--time-scale 2]
    python bench/qos_burst.py --workload steady [--duration 300] [--load 0.85]
    qos-serve bench [the same flags]

Writes one CSV of per-request outcomes per policy to --plots. With both policies: prints the
comparison table, writes the plots to --plots (TTFT CDF, KV blocks and queue depth over time) and
the report to --json; with one (--policies qos), prints its figures as JSON instead.
Workloads: bench/qos_workloads.py; figures, table, CSV and plots: bench/qos_report.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench.harness import PRIORITIES, machine, make_parser, model_or_bench, progress, quantile, write_json  # noqa: E402
from bench.loadgen import Front, Job, Outcome, run_clients  # noqa: E402
from bench.qos_report import Sample, plot, print_table, summarise, ttft_parts, write_outcomes  # noqa: E402
from bench.qos_workloads import (  # noqa: E402
    STEADY_SHARES,
    TRACES,
    burst_workload,
    saturation_workload,
    steady_workload,
    trace_workload,
)
from services.common.config import (  # noqa: E402
    KV_CAP_MODES,
    RouterConfig,
    SchedulerConfig,
    WorkerConfig,
    single_pool,
)
from services.common.priority import priority_name  # noqa: E402
from services.common.proto.qos.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402


async def run_jobs(front: Front, cluster: LocalCluster, jobs: list[Job], bar) -> tuple[list, list, float]:
    """Send the jobs (one client process per priority, bench/loadgen.py) while sampling the
    pool's stats every 0.1 s. Returns outcomes, samples (times from the common start), wall s."""
    stamped: list[tuple[float, Sample]] = []

    async def sample_stats(stop: asyncio.Event):
        trust = cluster.trust
        async with trust.channel(cluster.scheduler_address, "scheduler") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while not stop.is_set():
                s = await stub.GetPoolStats(scheduler_pb2.PoolStatsRequest(), metadata=trust.metadata)
                stamped.append((time.time(), Sample(0.0, {priority_name(c.priority): c.kv_blocks for c in s.classes},
                                                    {priority_name(c.priority): c.waiting for c in s.classes},
                                                    s.kv_blocks_total)))
                await asyncio.sleep(0.1)

    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_stats(stop))
    outcomes, start = await run_clients(front, jobs, on_progress=bar.update)
    wall = time.time() - start
    stop.set()
    await sampler
    samples = []
    for stamp, sample in stamped:
        if stamp >= start:
            sample.at = stamp - start
            samples.append(sample)
    return outcomes, samples, wall


IDLE_PROBES = 12          # High requests sent one at a time to the idle cluster before the workload
IDLE_GAP_S = 0.75         # between them: each is alone in the cluster


def idle_probe_jobs(jobs: list[Job]) -> list[Job]:
    """High requests like the workload's own (prompts taken evenly from its High jobs, so the same
    lengths), one token each, spaced so that none overlaps another: their TTFT is High's idle
    latency on this cluster, the yardstick for its tail under load."""
    high = [j for j in jobs if j.priority == "high"]
    if not high:
        return []
    picks = [high[i * len(high) // IDLE_PROBES] for i in range(min(IDLE_PROBES, len(high)))]
    return [Job("high", j.prompt, j.prompt_tokens, max_tokens=1, at=i * IDLE_GAP_S, tenant=j.tenant)
            for i, j in enumerate(picks)]


async def idle_high_ttft(front: Front, jobs: list[Job]) -> dict:
    """The idle probes' P50 TTFT, and the P50 of each of its parts (qos_report.ttft_parts); NaN
    without High jobs or if none succeeded (the parts are NaN over HTTP too)."""
    probes = idle_probe_jobs(jobs)
    outcomes = [o for o in (await run_clients(front, probes))[0] if o.ok] if probes else []
    return {"idle_high_p50_ttft_ms": quantile([o.ttft_ms for o in outcomes], 0.5),
            "idle_high_p50_ttft_parts_ms": ttft_parts(outcomes, 0.5)}


# QoS variants a run may add to --policies, each its own cluster and column: qos-elastic, elastic
# KV caps; qos-nocutin, no High cut-ins; qos-inslots, cut-ins within max_running only; qos-pertoken, every class streams a chunk per token (not
# Medium 4 and Low 16 a chunk); qos-calls, a Submit call per request from the router instead of
# the pool's SubmitLink stream.
VARIANTS = {"elastic": {"kv_cap_mode": "elastic"}, "nocutin": {"high_cut_in": False},
            "inslots": {"high_cut_in_slots": 0.0},
            "pertoken": {"stream_intervals": [1, 1, 1]}}
ROUTER_VARIANTS = {"calls": {"scheduler_link": "calls"}}


def cluster_config(name: str, model: str, args):
    policy, _, variant = name.partition("-")
    known = VARIANTS.keys() | ROUTER_VARIANTS.keys()
    if variant and (policy != "qos" or variant not in known):
        raise SystemExit(f"unknown policy {name!r}: fcfs, qos, or qos-"
                         + ", qos-".join([*VARIANTS, *ROUTER_VARIANTS]))
    settings = {"kv_cap_mode": args.kv_cap_mode, **VARIANTS.get(variant, {})}
    config = single_pool(
        # The baseline is priority-blind end to end: FIFO admission at the router too.
        model=model, router=RouterConfig(port=0, http_port=0, admission="fifo" if policy == "fcfs" else "priority",
                                         **ROUTER_VARIANTS.get(variant, {})),
        scheduler=SchedulerConfig(port=0, policy=policy, max_step_tokens=args.max_step_tokens,
                                  max_running=args.max_running, **settings),
        workers=[WorkerConfig(port=0, threads=args.threads, kv_cache_mb=args.kv_cache_mb,
                              dtype=getattr(args, "dtype", None))])
    return config


def measure_capacity(model: str, tokenizer, max_context: int, args) -> float:
    """Requests per second of the steady mix the cluster completes when saturated: a batch of
    --capacity-requests sent at once to a FCFS cluster, completed / seconds until the last ends."""
    jobs = saturation_workload(tokenizer, max_context, args.capacity_requests, args.seed)
    with LocalCluster(cluster_config("fcfs", model, args), quiet=True) as cluster:
        with progress(len(jobs), "capacity") as bar:
            outcomes, _ = asyncio.run(run_clients(Front.of(args.front, cluster), jobs, on_progress=bar.update))
    done = [o for o in outcomes if o.ok]
    return len(done) / max(o.done_at for o in done)


def run_policy(policy: str, model: str, jobs: list[Job], args, during=None) -> tuple[dict, list[Outcome], list[Sample]]:
    """Start a local cluster with `policy`, send `jobs` through it, stop it; the summary figures.
    `during(cluster)`, if given, is a context manager held while the jobs run (e.g. an open
    console: bench/console_overhead.py)."""
    config = cluster_config(policy, model, args)
    log_dir = args.log_dir / policy if getattr(args, "log_dir", None) else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    with LocalCluster(config, log_dir=log_dir, quiet=True) as cluster, \
            (during(cluster) if during else contextlib.nullcontext()):
        front = Front.of(args.front, cluster)
        idle = asyncio.run(idle_high_ttft(front, jobs))
        before = asyncio.run(cluster.pool_stats())     # the probes' share
        with progress(len(jobs), f"{policy:>4}") as bar:
            outcomes, samples, wall = asyncio.run(run_jobs(front, cluster, jobs, bar))
        stats = asyncio.run(cluster.pool_stats())
    low = next(c for c in stats.classes if priority_name(c.priority) == "low")
    summary = summarise(outcomes, low.kv_blocks_peak, stats.kv_blocks_total)
    summary["wall_s"] = wall
    summary["preemptions"] = stats.preemptions - before.preemptions
    summary["cut_ins"] = stats.cut_ins - before.cut_ins
    summary.update(idle)
    summary["high_p99_ttft_over_idle"] = summary["high_p99_ttft_ms"] / idle["idle_high_p50_ttft_ms"]
    summary["dtype"] = stats.members[0].dtype          # what the worker computed in
    # Work preemption threw away: tokens preempted sequences had computed (done again later),
    # over all tokens computed during the workload.
    computed = sum(c.served_tokens for c in stats.classes) - sum(c.served_tokens for c in before.classes)
    recomputed = sum(c.recomputed_tokens for c in stats.classes) - sum(c.recomputed_tokens for c in before.classes)
    summary["recompute_share"] = recomputed / computed if computed else 0.0
    return summary, outcomes, samples


def parse_args(argv: list[str] | None = None):
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--model", help="model folder (default: the random-weight bench model)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every request count")
    parser.add_argument("--high-rate", type=float, default=10.0, help="High arrivals per second")
    parser.add_argument("--flood-seconds", type=float, default=1.0,
                        help="Low and Medium arrive at uniform random times in [0, this) (0: all at once)")
    parser.add_argument("--threads", type=int, default=1, help="worker torch threads")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="the worker's dtype (default: the host's)")
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--max-step-tokens", type=int, default=128,
                        help="scheduler's tokens per step (bounds a step's time, so High's wait)")
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--policies", default="fcfs,qos",
                        help="comma-separated: fcfs, qos, and QoS variants qos-elastic, qos-nocutin, qos-inslots, qos-pertoken, "
                             "qos-calls (one column each)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="keep each cluster's process logs under this folder (one subfolder per policy)")
    parser.add_argument("--kv-cap-mode", choices=KV_CAP_MODES, default="strict", help="qos: KV caps")
    parser.add_argument("--front", choices=["grpc", "http"], default="grpc",
                        help="send through the router's gRPC or its OpenAI-compatible HTTP front (SSE)")
    parser.add_argument("--plots", type=Path, default=Path("bench/results"),
                        help="folder for the plots and the per-request CSVs")
    parser.add_argument("--workload", choices=["burst", "steady"], default="burst")
    parser.add_argument("--duration", type=float, default=300.0, help="steady: seconds of arrivals")
    parser.add_argument("--load", type=float, default=0.85, help="steady: offered load, share of capacity")
    parser.add_argument("--capacity-requests", type=int, default=40,
                        help="steady: size of the saturating batch that measures capacity")
    parser.add_argument("--trace", choices=sorted(TRACES), help="replay a real trace instead of the burst")
    parser.add_argument("--trace-skip", type=int, default=0, help="rows to skip first")
    parser.add_argument("--trace-requests", type=int, default=300)
    parser.add_argument("--time-scale", type=float, default=1.0, help="divide arrival gaps by this")
    parser.add_argument("--length-scale", type=float, default=1.0, help="multiply token lengths by this")
    parser.add_argument("--high-prompt-min", type=int, default=0,
                        help="trace: make High prompts at least this many tokens (long real-time prompts)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    model = model_or_bench(args.model)
    tokenizer = TextTokenizer.from_model_dir(model)
    max_context = load_model_config(model).max_context
    steady = {}
    if args.trace:
        jobs = trace_workload(tokenizer, max_context, args.trace, args.trace_skip, args.trace_requests,
                              args.time_scale, args.length_scale, args.seed, args.high_prompt_min)
    elif args.workload == "steady":
        capacity = measure_capacity(model, tokenizer, max_context, args)
        offered = args.load * capacity
        steady = {"capacity_rps": capacity, "offered_rps": offered}
        print(f"capacity {capacity:.2f} requests/s of the mix; offering {offered:.2f}/s "
              f"({args.load:.0%}) for {args.duration:.0f} s", file=sys.stderr)
        jobs = steady_workload(tokenizer, max_context, offered, args.duration, args.seed)
    else:
        jobs = burst_workload(tokenizer, max_context, args.scale, args.high_rate, args.seed,
                              args.flood_seconds)
    counts = {p: sum(1 for j in jobs if j.priority == p) for p in PRIORITIES}
    if args.trace:
        workload = (f"{args.trace} (rows {args.trace_skip}..{args.trace_skip + len(jobs)}, time /"
                    f"{args.time_scale:g}, lengths x{args.length_scale:g}"
                    + (f", High prompts >= {args.high_prompt_min}" if args.high_prompt_min else "") + ")")
    elif steady:
        workload = (f"steady (Poisson, {steady['offered_rps']:.2f} requests/s = {args.load:.0%} of the "
                    f"{steady['capacity_rps']:.2f}/s measured, {args.duration:.0f} s, mix "
                    + ":".join(f"{STEADY_SHARES[p]:g}" for p in PRIORITIES) + ")")
    else:
        workload = f"burst (Low and Medium over {args.flood_seconds:g} s, High {args.high_rate:g}/s)"
    report = {"model": Path(model).name, "workload": workload, **steady,
              "requests": ", ".join(f"{counts[p]} {p}" for p in PRIORITIES),
              # the burst's --scale (bench/qos_virtual.py --real simulates the same burst)
              **({"scale": args.scale} if not args.trace and args.workload == "burst" else {}),
              "front": args.front,
              "machine": f"{machine()}; worker {args.threads} thread(s), "
                         f"step budget {args.max_step_tokens} tokens, up to {args.max_running} running"}
    runs = {}
    for policy in args.policies.split(","):
        summary, outcomes, samples = run_policy(policy, model, jobs, args)
        report[policy] = summary
        runs[policy] = (outcomes, samples)
        print(f"per-request outcomes: {write_outcomes(outcomes, args.plots / f'outcomes_{policy}.csv')}",
              file=sys.stderr)
    report["policies"] = list(runs)
    if {"fcfs", "qos"} <= set(runs):
        print_table(report)
        for path in plot(report, runs, args.plots):
            print(f"plot: {path}")
    else:                                     # no FCFS-vs-QoS table to print: the figures as JSON
        print(json.dumps(report, indent=2))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
