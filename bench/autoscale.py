#!/usr/bin/env python
"""Autoscaling from the High backlog: the same High burst against a one-worker pool, once with
autoscaling off (max 1 worker) and once on (up to --max-workers, the launcher of `qos-serve up
--autoscale`: extra CPU workers join at run time, and are drained away once the pool is idle).

--requests (200) High requests arrive over --spread seconds (2); at most 16 run at once per
worker, so the High backlog passes the pool's scale_out_high_backlog (100) within a second. The
pool's stats are sampled every 0.5 s for a timeline.

    python bench/autoscale.py [--json PATH] [--plot PNG] [--requests 200] [--max-workers 3]

Writes high_p99_ttft_ms_off/on, drain_seconds_off/on (first arrival to last answer),
workers_max (with autoscaling on), scale_in_seconds (burst over -> back to one worker), lost
(requests with neither an answer nor an error: must be 0) and failed, for each run.

On this project's 2-core machine extra workers share the same two cores with the router, the
scheduler and the clients, so they add little compute: what this shows is the mechanism (scale
out on the backlog, take work, drain back to the minimum, lose nothing), not a speed-up that
needs more hardware.
"""
from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.harness import machine, make_parser, progress, quantile, write_json  # noqa: E402
from bench.loadgen import Front, Job, run_clients  # noqa: E402
from bench.qos_workloads import text_of_tokens  # noqa: E402
from services.common.config import AutoscaleConfig, RouterConfig, SchedulerConfig, WorkerConfig, single_pool  # noqa: E402
from services.common.proto.qos.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402

PROMPT_TOKENS, OUTPUT_TOKENS, MAX_RUNNING = 64, 32, 16


class Sampler:
    """The pool's workers, desired workers and High backlog every 0.5 s, in a thread."""

    def __init__(self, address: str, trust):
        self.address, self.samples, self.start = address, [], time.time()
        self.trust = trust
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.trust.sync_channel(self.address, "scheduler") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while not self._stop.wait(0.5):
                try:
                    s = stub.GetPoolStats(scheduler_pb2.PoolStatsRequest(), timeout=5, metadata=self.trust.metadata)
                except grpc.RpcError:
                    continue
                self.samples.append((time.time() - self.start, s.workers, s.desired_workers, s.classes[0].waiting))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_once(model: str, jobs: list[Job], autoscale: bool, args) -> dict:
    scaling = AutoscaleConfig(max_workers=args.max_workers if autoscale else 1, scale_out_cooldown_s=5.0,
                              scale_in_after_s=10.0, scale_in_cooldown_s=10.0)
    config = single_pool(model=model, router=RouterConfig(port=0, http_port=-1),
                         scheduler=SchedulerConfig(port=0, max_step_tokens=256, max_running=MAX_RUNNING),
                         workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=256)])
    config.pools[0].autoscale = scaling
    label = f"autoscale {'on' if autoscale else 'off'}"
    with LocalCluster(config, quiet=True, autoscale=autoscale) as cluster:
        with Sampler(cluster.scheduler_address, cluster.trust) as sampler, progress(len(jobs), label) as bar:
            outcomes, start = asyncio.run(run_clients(Front.of("grpc", cluster), jobs, on_progress=bar.update))
            offset = start - sampler.start          # the clients' t=0 on the sampler's clock
            burst_over = time.time()
            scale_in_s = None
            while autoscale and time.time() - burst_over < 120:     # back to one worker
                if sampler.samples and sampler.samples[-1][1] == 1 and not cluster.autoscaler.extras["cpu"]:
                    scale_in_s = time.time() - burst_over
                    break
                time.sleep(0.5)
    ok = [o for o in outcomes if o.ok]
    return {"p99": quantile([o.ttft_ms for o in ok], 0.99), "p50": quantile([o.ttft_ms for o in ok], 0.5),
            "drain_s": max(o.done_at for o in outcomes) - min(j.at for j in jobs),
            "failed": len(outcomes) - len(ok), "lost": len(jobs) - len(outcomes),
            "workers_max": max(s[1] for s in sampler.samples),
            "backlog_max": max(s[3] for s in sampler.samples), "scale_in_s": scale_in_s,
            "timeline": [(t - offset, w, d, b) for t, w, d, b in sampler.samples]}


def plot(path: Path, off: dict, on: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for label, run, style in (("autoscale off", off, "--"), ("autoscale on", on, "-")):
        t = [s[0] for s in run["timeline"]]
        top.plot(t, [s[3] for s in run["timeline"]], style, label=f"High backlog, {label}")
        bottom.step(t, [s[1] for s in run["timeline"]], style, where="post", label=f"workers, {label}")
    on_t = [s[0] for s in on["timeline"]]
    bottom.step(on_t, [s[2] for s in on["timeline"]], ":", where="post", label="desired workers (on)")
    top.axhline(100, color="grey", linewidth=0.8)
    top.text(0, 102, "scale_out_high_backlog = 100", fontsize=8, color="grey")
    top.set_ylabel("High requests waiting")
    bottom.set_ylabel("workers")
    bottom.yaxis.get_major_locator().set_params(integer=True)
    bottom.set_xlabel("seconds since the burst began")
    for axis in (top, bottom):
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    fig.suptitle("High burst against one worker: autoscaling off vs on")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--spread", type=float, default=2.0, help="arrivals over this many seconds")
    parser.add_argument("--max-workers", type=int, default=3)
    parser.add_argument("--plot", type=Path, help="write the timeline as a PNG")
    parser.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M)")
    args = parser.parse_args()
    from services.local.cluster import resolve_model
    model = resolve_model(args.model or "default")
    rng = random.Random(args.seed)
    tokenizer = TextTokenizer.from_model_dir(model)
    jobs = []
    for _ in range(args.requests):
        text, n = text_of_tokens(tokenizer, rng, PROMPT_TOKENS)
        jobs.append(Job("high", text, n, OUTPUT_TOKENS, rng.uniform(0.0, args.spread)))
    off, on = run_once(model, jobs, False, args), run_once(model, jobs, True, args)
    print(f"\n{args.requests} High requests over {args.spread:g} s ({PROMPT_TOKENS} prompt + {OUTPUT_TOKENS} "
          f"output tokens), {MAX_RUNNING} running per worker; {Path(model).name}; {machine()}\n")
    print(f"{'':<26}{'autoscale off':>14}{'autoscale on':>14}")
    print(f"{'High P99 TTFT (ms)':<26}{off['p99']:>14.0f}{on['p99']:>14.0f}")
    print(f"{'High P50 TTFT (ms)':<26}{off['p50']:>14.0f}{on['p50']:>14.0f}")
    print(f"{'drain time (s)':<26}{off['drain_s']:>14.1f}{on['drain_s']:>14.1f}")
    print(f"{'most High waiting':<26}{off['backlog_max']:>14}{on['backlog_max']:>14}")
    print(f"{'most workers':<26}{off['workers_max']:>14}{on['workers_max']:>14}")
    print(f"{'lost / failed':<26}{off['lost']:>9} / {off['failed']:<3}{on['lost']:>9} / {on['failed']:<3}")
    back = f"{on['scale_in_s']:.1f} s after the burst" if on["scale_in_s"] is not None else "NOT within 120 s"
    print(f"back to 1 worker: {back}")
    if args.plot:
        plot(args.plot, off, on)
        print(f"timeline: {args.plot}")
    write_json(args.json, {
        "high_p99_ttft_ms_off": off["p99"], "high_p99_ttft_ms_on": on["p99"],
        "high_p50_ttft_ms_off": off["p50"], "high_p50_ttft_ms_on": on["p50"],
        "drain_seconds_off": off["drain_s"], "drain_seconds_on": on["drain_s"],
        "workers_max": on["workers_max"], "scale_in_seconds": on["scale_in_s"],
        "backlog_max_off": off["backlog_max"], "backlog_max_on": on["backlog_max"],
        "lost": off["lost"] + on["lost"], "failed": off["failed"] + on["failed"],
        "requests": args.requests, "machine": machine()})


if __name__ == "__main__":
    main()
