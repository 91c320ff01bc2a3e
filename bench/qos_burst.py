#!/usr/bin/env python
"""The QoS benchmark: the same burst, first-come-first-served and then QoS, side by side.

For each policy the driver starts a local cluster itself (router, scheduler, one CPU worker as
separate processes), sends the workload through the router over gRPC, samples the pool's stats
while it runs, and stops the cluster. Same requests, same seed, same model, same machine.

Workload `burst` (default; counts scale with --scale):
  Low    300 requests, the longest prompts the model allows (>= 8x Medium), 128 output tokens
  Medium 500 requests, ~256-token prompts, 64 output tokens
  High   200 requests, ~32-token prompts, 32 output tokens
Low and Medium flood in at uniform random times within the first --flood-seconds (1 s: 800
requests a second; 0: all at the same instant); High arrives as a Poisson stream (--high-rate
per second) during the flood. Output lengths are fixed (ignore_eos). Each priority is sent by its
own client process (services/loadgen.py), at a lower CPU priority than the services under test.
The FCFS run is priority-blind end to end (FCFS scheduler policy, FIFO admission at the router).

Trace replay (`--trace azure-code` or `azure-conv`, from bench/traces/, Azure 2023, CC-BY 4.0):
the first --trace-requests rows after --trace-skip, arrival gaps divided by --time-scale, input
and output lengths multiplied by --length-scale and capped to fit the model's context. Priority
rule, from what each request looks like: output <= 64 tokens and input <= 1,024 tokens -> High
(interactive, short), input > 2,048 tokens -> Low (long-context, batch-like), else Medium.

    python bench/qos_burst.py [--scale 0.2] [--json out.json] [--plots DIR] [--model DIR]
    python bench/qos_burst.py --trace azure-code [--trace-requests 300] [--time-scale 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
import os
import random
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
from tqdm import tqdm  # noqa: E402

from services.common.percentile import percentile  # noqa: E402
from services.cluster import LocalCluster  # noqa: E402
from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool  # noqa: E402
from services.common.priority import priority_name  # noqa: E402
from services.common.proto.qos.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.engine.device import CpuBackend  # noqa: E402
from services.loadgen import Job, Outcome, run_clients  # noqa: E402

PRIORITIES = ("high", "medium", "low")
WORDS = ("time river stone light paper green music table window garden number market summer "
         "letter story island silver morning travel bridge").split()


@dataclass(slots=True)
class Sample:
    at: float
    kv: dict = field(default_factory=dict)        # priority -> blocks
    waiting: dict = field(default_factory=dict)   # priority -> requests
    total_blocks: int = 0


def text_of_tokens(tokenizer: TextTokenizer, rng: random.Random, tokens: int) -> tuple[str, int]:
    """A prompt of about `tokens` tokens of ordinary words; returns it with its exact length."""
    words = [rng.choice(WORDS) for _ in range(tokens)]
    text = " ".join(words)
    ids = tokenizer.encode(text)
    if len(ids) > tokens:       # trim to the budget exactly
        text = tokenizer.decode(ids[:tokens])
        ids = tokenizer.encode(text)
    return text, len(ids)


TRACES = {"azure-code": "azure2023_code.csv", "azure-conv": "azure2023_conv.csv"}


def trace_priority(input_tokens: int, output_tokens: int) -> str:
    if output_tokens <= 64 and input_tokens <= 1024:
        return "high"
    if input_tokens > 2048:
        return "low"
    return "medium"


def trace_workload(tokenizer, max_context: int, trace: str, skip: int, count: int,
                   time_scale: float, length_scale: float, seed: int) -> list[Job]:
    import csv
    from datetime import datetime

    rng = random.Random(seed)
    path = Path(__file__).resolve().parent / "traces" / TRACES[trace]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))[skip:skip + count]
    if not rows:
        raise SystemExit(f"{path} has no rows after --trace-skip {skip}")

    def seconds(stamp: str) -> float:
        return datetime.strptime(stamp[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()

    start = seconds(rows[0]["TIMESTAMP"])
    jobs = []
    for row in rows:
        # The priority comes from the trace's own lengths, before scaling.
        context, generated = int(row["ContextTokens"]), int(row["GeneratedTokens"])
        priority = trace_priority(context, generated)
        out = max(1, min(int(generated * length_scale), max_context // 4))
        prompt_len = max(1, min(int(context * length_scale), max_context - out - 16))
        text, n = text_of_tokens(tokenizer, rng, prompt_len)
        jobs.append(Job(priority, text, n, out, (seconds(row["TIMESTAMP"]) - start) / time_scale))
    return jobs


def burst_workload(tokenizer, max_context: int, scale: float, high_rate: float, seed: int,
                   flood_seconds: float) -> list[Job]:
    rng = random.Random(seed)
    arrivals = random.Random(seed + 1)   # arrival times apart, so the prompts do not depend on them
    medium_prompt = 256
    low_prompt = min(max_context - 128 - 16, 16 * medium_prompt)
    if low_prompt < 8 * medium_prompt:
        raise SystemExit(f"the model's context ({max_context}) is too short for Low prompts of "
                         f">= {8 * medium_prompt} tokens")
    jobs = []
    for priority, count, prompt_len, out in [("low", 300, low_prompt, 128), ("medium", 500, medium_prompt, 64)]:
        for _ in range(max(1, round(count * scale))):
            text, n = text_of_tokens(tokenizer, rng, prompt_len)
            jobs.append(Job(priority, text, n, out, arrivals.uniform(0.0, flood_seconds)))
    t = 0.0
    for _ in range(max(1, round(200 * scale))):
        t += rng.expovariate(high_rate)
        text, n = text_of_tokens(tokenizer, rng, 32)
        jobs.append(Job("high", text, n, 32, t))
    return jobs


async def run_jobs(address: str, scheduler_address: str, jobs: list[Job], bar) -> tuple[list, list, float]:
    """Send the jobs (one client process per priority, services/loadgen.py) while sampling the
    pool's stats every 0.1 s. Returns outcomes, samples (times from the common start), wall s."""
    stamped: list[tuple[float, Sample]] = []

    async def sample_stats(stop: asyncio.Event):
        async with grpc.aio.insecure_channel(scheduler_address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while not stop.is_set():
                s = await stub.GetPoolStats(scheduler_pb2.PoolStatsRequest())
                stamped.append((time.time(), Sample(0.0, {priority_name(c.priority): c.kv_blocks for c in s.classes},
                                                    {priority_name(c.priority): c.waiting for c in s.classes},
                                                    s.kv_blocks_total)))
                await asyncio.sleep(0.1)

    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_stats(stop))
    outcomes, start = await run_clients(address, jobs, on_progress=bar.update)
    wall = time.time() - start
    stop.set()
    await sampler
    samples = []
    for stamp, sample in stamped:
        if stamp >= start:
            sample.at = stamp - start
            samples.append(sample)
    return outcomes, samples, wall


def write_outcomes(outcomes: list[Outcome], path: Path) -> Path:
    """One CSV row per request (times in ms, sent/done in seconds after the start)."""
    import csv
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in fields(Outcome)]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        for outcome in sorted(outcomes, key=lambda o: o.sent_at):
            writer.writerow([getattr(outcome, name) for name in names])
    return path


def p99(values) -> float:
    return percentile(values, 0.99, float("nan"))


def summarise(outcomes: list[Outcome], samples: list[Sample], low_kv_peak_blocks: int,
              total_blocks: int) -> dict:
    def of(priority):
        return [o for o in outcomes if o.priority == priority]

    ok = {p: [o for o in of(p) if o.ok] for p in PRIORITIES}
    low_done = max((o.done_at for o in ok["low"]), default=0.0)
    return {
        "high_p99_ttft_ms": p99([o.ttft_ms for o in ok["high"]]),
        "high_p99_e2e_ms": p99([o.e2e_ms for o in ok["high"]]),
        # Where High's time goes: the scheduler's own view, without the gRPC hops and client.
        "high_p99_server_ttft_ms": p99([o.server_ttft_ms for o in ok["high"]]),
        "high_p50_ttft_ms": percentile([o.ttft_ms for o in ok["high"]], 0.5, float("nan")),
        "high_success_rate": len(ok["high"]) / max(1, len(of("high"))),
        "medium_p99_ttft_ms": p99([o.ttft_ms for o in ok["medium"]]),
        "low_tok_s": sum(o.tokens for o in ok["low"]) / low_done if low_done else 0.0,
        "low_kv_peak_frac": low_kv_peak_blocks / total_blocks if total_blocks else 0.0,
        **{f"rejected_{p}": sum(1 for o in of(p) if o.code == "RESOURCE_EXHAUSTED") for p in PRIORITIES},
        "failed_other": sum(1 for o in outcomes if not o.ok and o.code != "RESOURCE_EXHAUSTED"),
        "failed_codes": dict(Counter(f"{o.priority}:{o.code}" for o in outcomes
                                     if not o.ok and o.code != "RESOURCE_EXHAUSTED")),
    }


def run_policy(policy: str, model: str, jobs: list[Job], args) -> tuple[dict, list, list]:
    config = single_pool(
        # The baseline is priority-blind end to end: FIFO admission at the router too.
        model=model, router=RouterConfig(port=0, admission="fifo" if policy == "fcfs" else "priority"),
        scheduler=SchedulerConfig(port=0, policy=policy, max_step_tokens=args.max_step_tokens,
                                  max_running=args.max_running),
        workers=[WorkerConfig(port=0, threads=args.threads, kv_cache_mb=args.kv_cache_mb)])
    with LocalCluster(config, quiet=True) as cluster:
        with tqdm(total=len(jobs), desc=f"{policy:>4}", unit="req", file=sys.stderr) as bar:
            outcomes, samples, wall = asyncio.run(run_jobs(cluster.router_address,
                                                           cluster.scheduler_address, jobs, bar))

        async def final_stats():
            async with grpc.aio.insecure_channel(cluster.scheduler_address) as channel:
                return await scheduler_pb2_grpc.SchedulerStub(channel).GetPoolStats(
                    scheduler_pb2.PoolStatsRequest())
        stats = asyncio.run(final_stats())
    low = next(c for c in stats.classes if priority_name(c.priority) == "low")
    summary = summarise(outcomes, samples, low.kv_blocks_peak, stats.kv_blocks_total)
    summary["wall_s"] = wall
    summary["preemptions"] = stats.preemptions
    return summary, outcomes, samples


def plot(report: dict, runs: dict, directory: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    colors = {"high": "tab:red", "medium": "tab:orange", "low": "tab:blue"}
    paths = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, style in (("fcfs", "--"), ("qos", "-")):
        for priority in PRIORITIES:
            values = sorted(o.ttft_ms for o in runs[policy][0] if o.ok and o.priority == priority)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], style,
                        color=colors[priority], label=f"{priority} ({policy})")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF, {report['workload']}, {report['model']}")
    ax.axvline(200, color="grey", lw=0.8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(directory / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    for key, ylabel, name in (("kv", "KV blocks held (% of pool)", "kv_blocks.png"),
                              ("waiting", "requests waiting", "queue_depth.png")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, policy in zip(axes, ("fcfs", "qos")):
            samples = runs[policy][1]
            xs = [s.at for s in samples]
            for priority in PRIORITIES:
                ys = [getattr(s, key).get(priority, 0) * (100 / s.total_blocks if key == "kv" and s.total_blocks else 1)
                      for s in samples]
                ax.plot(xs, ys, color=colors[priority], label=priority)
            if key == "kv":
                ax.axhline(30, color="tab:blue", lw=0.8, ls=":", label="Low cap 30%")
            ax.set_title(policy)
            ax.set_xlabel("seconds")
        axes[0].set_ylabel(ylabel)
        axes[1].legend(fontsize=8)
        fig.tight_layout()
        paths.append(directory / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


KEYS = [("high_p99_ttft_ms", "High P99 TTFT (ms)", "{:.0f}"),
        ("high_p50_ttft_ms", "High P50 TTFT (ms)", "{:.0f}"),
        ("high_p99_server_ttft_ms", "High P99 TTFT at scheduler", "{:.0f}"), ("high_p99_e2e_ms", "High P99 e2e (ms)", "{:.0f}"),
        ("high_success_rate", "High success rate", "{:.1%}"), ("medium_p99_ttft_ms", "Medium P99 TTFT (ms)", "{:.0f}"),
        ("low_tok_s", "Low throughput (tok/s)", "{:.0f}"), ("low_kv_peak_frac", "Low KV peak (% blocks)", "{:.1%}"),
        ("rejected_high", "rejected High", "{}"), ("rejected_medium", "rejected Medium", "{}"),
        ("rejected_low", "rejected Low", "{}"), ("preemptions", "preemptions", "{}"), ("wall_s", "wall time (s)", "{:.0f}")]


def print_table(report: dict) -> None:
    print(f"\nworkload {report['workload']}: {report['requests']}; model {report['model']}; "
          f"{report['machine']}\n")
    print(f"{'':<26}{'FCFS':>12}{'QoS':>12}{'change':>14}")
    for key, label, fmt in KEYS:
        a, b = report["fcfs"][key], report["qos"][key]
        change = ""
        if isinstance(a, float) and isinstance(b, float) and a and b and key != "high_success_rate":
            # Big drops read better as "how many times lower" than as 0.00x.
            change = f"{a / b:,.0f}x lower" if a / b >= 10 else f"{b / a:.2f}x"
        print(f"{label:<26}{fmt.format(a):>12}{fmt.format(b):>12}{change:>14}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the random-weight bench model)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every request count")
    parser.add_argument("--high-rate", type=float, default=10.0, help="High arrivals per second")
    parser.add_argument("--flood-seconds", type=float, default=1.0,
                        help="Low and Medium arrive at uniform random times in [0, this) (0: all at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="worker torch threads")
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--max-step-tokens", type=int, default=128,
                        help="scheduler's tokens per step (bounds a step's time, so High's wait)")
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--policies", default="fcfs,qos", help="comma-separated, for quick checks of one policy")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plots", type=Path, default=Path("bench/results"))
    parser.add_argument("--trace", choices=sorted(TRACES), help="replay a real trace instead of the burst")
    parser.add_argument("--trace-skip", type=int, default=0, help="rows to skip first")
    parser.add_argument("--trace-requests", type=int, default=300)
    parser.add_argument("--time-scale", type=float, default=1.0, help="divide arrival gaps by this")
    parser.add_argument("--length-scale", type=float, default=1.0, help="multiply token lengths by this")
    args = parser.parse_args()

    if args.model:
        model = args.model
    else:
        from services.engine.bench_model import bench_model_dir
        model = str(bench_model_dir())
    tokenizer = TextTokenizer.from_model_dir(model)
    max_context = load_model_config(model).max_context
    if args.trace:
        jobs = trace_workload(tokenizer, max_context, args.trace, args.trace_skip, args.trace_requests,
                              args.time_scale, args.length_scale, args.seed)
    else:
        jobs = burst_workload(tokenizer, max_context, args.scale, args.high_rate, args.seed,
                              args.flood_seconds)
    counts = {p: sum(1 for j in jobs if j.priority == p) for p in PRIORITIES}
    cpu = CpuBackend().name
    workload = (f"{args.trace} (rows {args.trace_skip}..{args.trace_skip + len(jobs)}, time /"
                f"{args.time_scale:g}, lengths x{args.length_scale:g})" if args.trace
                else f"burst (Low and Medium over {args.flood_seconds:g} s, High {args.high_rate:g}/s)")
    report = {"model": Path(model).name, "workload": workload,
              "requests": ", ".join(f"{counts[p]} {p}" for p in PRIORITIES),
              "machine": f"{cpu}, {len(os.sched_getaffinity(0))} cores; worker {args.threads} thread(s), "
                         f"step budget {args.max_step_tokens} tokens, up to {args.max_running} running"}
    runs = {}
    for policy in args.policies.split(","):
        summary, outcomes, samples = run_policy(policy, model, jobs, args)
        report[policy] = summary
        runs[policy] = (outcomes, samples)
        print(f"per-request outcomes: {write_outcomes(outcomes, args.plots / f'outcomes_{policy}.csv')}",
              file=sys.stderr)
    if set(runs) != {"fcfs", "qos"}:
        print(json.dumps(report, indent=2))
        return
    print_table(report)
    for path in plot(report, runs, args.plots):
        print(f"plot: {path}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
