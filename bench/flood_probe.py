#!/usr/bin/env python
"""High's first token during the burst's flood, in a minute: the full-scale burst of
bench/qos_burst.py cut to the part that sets its High P99 (issue 20, target 4), with the CPU every
process and thread took meanwhile.

Why: a full-scale burst takes 8-10 minutes a policy, and its High P99 over 200 requests is set
by the ~14 High requests sent during the flood's first second (800 Low and Medium requests
arriving at once), when the router, the scheduler, the client processes and the worker share
this machine's cores. Each run here starts a fresh cluster, measures High's idle TTFT on it (as
qos_burst does), then sends the same flood with only the High requests sent in its first
--window seconds, and stops once those are answered (the flood's clients are killed, which
cancels their requests): ~20 s a run, so a change can be tried over many runs.

    python bench/flood_probe.py [--runs 3] [--window 1.3] [--policies qos,qos-nolane] [--json PATH]

Other options are bench/qos_burst.py's (--policies, here qos by default, --model, --seed,
--max-running, ...); policies alternate run by run. Prints per run each High request's TTFT at
the client and at the scheduler, the CPU each process took over the flood's first --cpu-seconds
(in cores) and its busiest threads; then per policy the flood High TTFT over idle P50 (median,
P90, max, share above 2x) over all runs, beside the idle P50, with python_loop_ns (calibration).
Linux only (/proc).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import calibration_line, machine, model_or_bench, python_loop_ns, quantile, write_json  # noqa: E402
from bench.loadgen import Front, Job, Outcome, run_clients  # noqa: E402
from bench.qos_burst import cluster_config, idle_high_ttft, parse_args  # noqa: E402
from bench.qos_workloads import burst_workload  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[tuple[int, str, int], float]:
    """CPU seconds so far of each thread of `pid`, keyed (thread id, name, nice); {} once it is gone."""
    threads = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return threads
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()     # fields[11:13]: utime, stime; [16]: nice
        threads[(int(tid), name, int(fields[16]))] = (int(fields[11]) + int(fields[12])) * TICK_S
    return threads


def children() -> dict[int, str]:
    """This process's child processes: pid -> what they are (a service's subcommand, or a client)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != os.getpid():
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        if "services.tools.cli" in words:       # python -m services.tools.cli worker --pool cpu --index 0 ...
            rest = words[words.index("services.tools.cli") + 1:]
            found[int(entry)] = rest[0] + (f"-{rest[rest.index('--index') + 1]}" if "--index" in rest else "")
        elif any("spawn_main" in w for w in words):     # bench/loadgen.py's client processes
            found[int(entry)] = "clients"
    return found


class CpuSampler:
    """Every thread's CPU time in this process's children, sampled every `period` s (a thread of
    its own, so that the event loop's work does not delay the samples)."""

    def __init__(self, period: float = 0.1):
        self.period = period
        self.samples: list[tuple[float, dict[int, str], dict[tuple[int, int, str, int], float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _run(self) -> None:
        names: dict[int, str] = {}
        last_scan = 0.0
        while not self._stop.is_set():
            now = time.time()
            if now - last_scan > 0.5:       # new client processes appear once a run
                names, last_scan = children(), now
            cpu = {(pid, *key): s for pid in names for key, s in thread_cpu(pid).items()}
            self.samples.append((now, dict(names), cpu))
            self._stop.wait(self.period)

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> tuple[float, dict[str, float], list[tuple[str, str, int, float]]]:
        """(seconds covered, cores per process kind, threads by cores taken: (process, thread name,
        nice, cores)) between the samples nearest `start` and `end`."""
        first = min(self.samples, key=lambda s: abs(s[0] - start))
        last = min(self.samples, key=lambda s: abs(s[0] - end))
        span = last[0] - first[0]
        if span <= 0:
            return 0.0, {}, []
        threads = []
        processes: dict[str, float] = {}
        for key, seconds in last[2].items():
            pid, _tid, name, nice = key
            used = seconds - first[2].get(key, 0.0)
            label = last[1].get(pid, "?")
            processes[label] = processes.get(label, 0.0) + used / span
            if used > 0:
                threads.append((label, name, nice, used / span))
        threads.sort(key=lambda t: -t[3])
        return span, processes, threads


def flood_jobs(jobs: list[Job], window: float) -> tuple[list[Job], list[Job]]:
    """(the flood: every Low and Medium job, the High jobs sent in its first `window` s)."""
    return ([j for j in jobs if j.priority != "high"],
            [j for j in jobs if j.priority == "high" and j.at < window])


def one_run(policy: str, model: str, jobs: list[Job], args, sampler: CpuSampler) -> dict:
    flood, high = flood_jobs(jobs, args.window)
    with LocalCluster(cluster_config(policy, model, args), quiet=True) as cluster:
        front = Front.of("grpc", cluster)
        idle = asyncio.run(idle_high_ttft(front, jobs))["idle_high_p50_ttft_ms"]
        outcomes, start = asyncio.run(run_clients(front, flood + high, until_done={"high"}))
        time.sleep(sampler.period * 2)
        span, processes, threads = sampler.between(start, start + args.cpu_seconds)
        for process in cluster.processes.values():   # the flood's requests are not waited for
            process.kill()
    return {"idle_high_p50_ttft_ms": idle, "cpu_span_s": span, "cpu_cores": processes,
            "busiest_threads": [{"process": p, "thread": t, "nice": n, "cores": c} for p, t, n, c in threads[:10]],
            "high": [asdict(o) for o in sorted(outcomes, key=lambda o: o.sent_at)]}


def print_run(policy: str, index: int, run: dict) -> None:
    high = [Outcome(**o) for o in run["high"]]
    print(f"{policy} run {index + 1}: idle P50 {run['idle_high_p50_ttft_ms']:.1f} ms; flood High TTFT "
          "client/scheduler ms: " + " ".join(f"{o.ttft_ms:.0f}/{o.server_ttft_ms:.0f}" if o.ok else o.code
                                             for o in high))
    cores = ", ".join(f"{name} {c:.2f}" for name, c in sorted(run["cpu_cores"].items(), key=lambda x: -x[1]))
    print(f"  CPU over the flood's first {run['cpu_span_s']:.2f} s, cores: {cores}")
    print("  busiest threads: " + ", ".join(f"{t['process']}/{t['thread']}(nice {t['nice']}) {t['cores']:.2f}"
                                            for t in run["busiest_threads"][:6]), flush=True)


def summary(runs: list[dict]) -> dict:
    over = [o["ttft_ms"] / r["idle_high_p50_ttft_ms"] for r in runs for o in r["high"] if o["ok"]]
    server = [o["server_ttft_ms"] for r in runs for o in r["high"] if o["ok"]]
    failed = sum(not o["ok"] for r in runs for o in r["high"])
    return {"runs": len(runs), "high_requests": len(over), "failed": failed,
            "idle_high_p50_ttft_ms": statistics.median(r["idle_high_p50_ttft_ms"] for r in runs),
            "over_idle_p50": quantile(over, 0.5), "over_idle_p90": quantile(over, 0.9),
            "over_idle_max": max(over, default=float("nan")),
            "share_over_2x": sum(x > 2 for x in over) / len(over) if over else float("nan"),
            "scheduler_ttft_p50_ms": quantile(server, 0.5), "scheduler_ttft_p90_ms": quantile(server, 0.9),
            "worker_cores": statistics.median(sum(c for k, c in r["cpu_cores"].items() if k.startswith("worker"))
                                              for r in runs)}


def main() -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--runs", type=int, default=3, help="fresh clusters per policy")
    own.add_argument("--window", type=float, default=1.3, help="High requests sent in this many s of the flood")
    own.add_argument("--cpu-seconds", type=float, default=1.2, help="CPU shares over this many s from the start")
    if "-h" in sys.argv or "--help" in sys.argv:
        print(__doc__)
        own.print_help()
        return
    mine, rest = own.parse_known_args()
    if not any(a.startswith("--policies") for a in rest):
        rest += ["--policies", "qos"]     # not qos_burst's fcfs,qos: FCFS's flood High waits minutes
    args = parse_args(rest)
    for key, value in vars(mine).items():
        setattr(args, key, value)
    model = model_or_bench(args.model)
    jobs = burst_workload(TextTokenizer.from_model_dir(model), load_model_config(model).max_context,
                          1.0, args.high_rate, args.seed, args.flood_seconds)
    loop_ns = python_loop_ns()
    policies = args.policies.split(",")
    print(machine(), file=sys.stderr)
    print(calibration_line(loop_ns), file=sys.stderr)
    results: dict[str, list[dict]] = {p: [] for p in policies}
    with CpuSampler() as sampler:
        for index in range(args.runs):        # policies alternate: the machine's drift hits both
            for policy in policies:
                run = one_run(policy, model, jobs, args, sampler)
                results[policy].append(run)
                print_run(policy, index, run)
    print("\n| policy | runs | idle High P50 | flood High TTFT over idle: P50 | P90 | max | share > 2x "
          "| at the scheduler P50 / P90 | worker cores |")
    print("|---|---|---|---|---|---|---|---|---|")
    summaries = {}
    for policy, runs in results.items():
        s = summaries[policy] = summary(runs)
        print(f"| {policy} | {s['runs']} | {s['idle_high_p50_ttft_ms']:.1f} ms | {s['over_idle_p50']:.2f}x | "
              f"{s['over_idle_p90']:.2f}x | {s['over_idle_max']:.2f}x | {s['share_over_2x']:.0%} | "
              f"{s['scheduler_ttft_p50_ms']:.1f} / {s['scheduler_ttft_p90_ms']:.1f} ms | {s['worker_cores']:.2f} |")
    print(f"\n{len(flood_jobs(jobs, args.window)[1])} High requests a run (those sent in the flood's first "
          f"{args.window:g} s); {calibration_line(loop_ns)}")
    write_json(args.json, {"machine": machine(), "python_loop_ns": loop_ns, "window_s": args.window,
                           "summary": summaries, "runs": results})


if __name__ == "__main__":
    main()
