#!/usr/bin/env python
"""Chaos: a steady mixed-priority load through two routers while faults come one at a time, every
--every seconds (20), in a fixed rotation (bench/chaos_faults.py): SIGKILL a worker, a scheduler
or a router (each restarted --restart-after seconds (2) later), SIGSTOP a worker past the step
timeout then SIGCONT it, 2% packet loss on every hop, a partition between a scheduler and a
worker, healed, 50 ms of delay (and 20 ms jitter) each way between a scheduler and a worker.
Counts what happened to every request; checks that every completed stream continued from exactly
the tokens its client held (bench/continuation.py: each token the greedy choice after the ones
before it, in the workers' dtype) and compares its text with a fault-free run (equal wherever the
numbers are batch-invariant: CPU workers in fp32, and in bf16 where the engine's kernels run it:
services/engine/step_layout.py); and every completion against the billing ledger.

Cluster: two routers sharing the store ([auth] replicas = 2), two pools ("a", the primary, and
"b"), each a scheduler and two CPU workers (1 thread, step timeout 5 s, --dtype or the host's),
the random-weight bench model (or --model: its greedy text repeats a token or two, so a lost
token shows only with a model that writes text, e.g. --model default); every worker behind a delay proxy (bench/delay_proxy.py). Loss and partition need a network namespace: run as root with iproute2 and
iptables and chaos.py re-runs itself inside one it makes (cluster and load on its own loopback);
elsewhere those two are left out and the JSON says why.

Load: --rate requests per second (Poisson), priorities in turn high / medium / low, alternately
on each router, prompts cycled from --prompts fixed ones (48-256 tokens), greedy, 64 output
tokens. A stream cut because its router died (or sent to it while it was down) counts in
failed_on_killed_router and is retried on the other router, as a client behind a load balancer
would; its final outcome counts like any other. The first --calm seconds have no fault.

    python bench/chaos.py [--minutes 5] [--json PATH]          # every fault kind
    python bench/chaos.py --soak [--json PATH]                  # 20 min; hangs, loss, partitions, delay

The soak keeps every process alive (no kills) so that its memory can be followed: rss_growth_pct
is the largest growth of any service's resident memory from the end of the warm-up (the first
two minutes) to the end.

Writes: submitted, completed, rejected (RESOURCE_EXHAUSTED: a limit, not a fault), failed (any
other error), lost (no final chunk and no error within --deadline), failed_on_killed_router,
migrated, failovers, dtype, continuations_checked, continuations_broken, texts_identical,
texts_diverged (and where they first part), texts_checked, texts_mismatched, unbilled
(completions without their ledger row), worker_kills, scheduler_kills, router_kills, hangs, losses, partitions,
delays, network_faults, soak_minutes, rss_growth_pct, high_p99_ttft_ms_calm, high_p99_ttft_ms_faults.
Targets: lost = 0, failed = 0, continuations_broken = 0, unbilled = 0, rss_growth_pct <= 10;
texts_mismatched = 0 where the workers are batch-invariant (written as batch_invariant).
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.chaos_faults import (KINDS, NETNS_ENV, NETWORK_KINDS, Faults, MemoryWatch, make_namespace,  # noqa: E402
                                network_unavailable, plot_memory)
from bench.continuation import GreedyChecker, continuity, texts_equal_undisturbed  # noqa: E402
from bench.delay_proxy import ProxiedCluster  # noqa: E402
from bench.harness import PRIORITIES, machine, make_parser, model_or_bench, progress, quantile, write_json  # noqa: E402
from bench.qos_workloads import text_of_tokens  # noqa: E402
from services.common.config import ClusterConfig, PoolConfig, RouterConfig, SchedulerConfig, WorkerConfig  # noqa: E402
from services.common.proto.qos.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402
from services.store.store import Store  # noqa: E402
from services.tools.client import RouterClient, sampling_params  # noqa: E402

OUTPUT_TOKENS = 64
POOLS = ("a", "b")
SOAK_MINUTES = 20.0
SOAK_KINDS = ("hang", "loss", "partition", "delay")
RECONNECT_GRACE_S = 20.0     # a client channel to a restarted router may still be backing off this long
RETRIES = 3


@dataclass(slots=True)
class Result:
    prompt: int
    priority: str
    sent_at: float
    router: int                   # which router it is on (0 or 1); a retry moves it
    status: str = "lost"          # completed, rejected, failed, lost
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    ttft_ms: float = float("nan")
    detail: str = ""
    request_id: str = ""
    cut_by_router: int = 0        # attempts cut because their router died


def cluster_config(model: str, store_url: str, dtype: str | None) -> ClusterConfig:
    def pool(name: str) -> PoolConfig:
        return PoolConfig(name=name, device="cpu", primary=name == "a",
                          scheduler=SchedulerConfig(port=0, max_step_tokens=128, orphan_grace_s=20.0,
                                                    step_timeout_s=5.0),
                          workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=128, dtype=dtype) for _ in range(2)])
    config = ClusterConfig(model=model, router=RouterConfig(port=0, http_port=-1), pools=[pool(n) for n in POOLS])
    config.auth.replicas, config.store.url, config.billing.flush_seconds = 2, store_url, 0.5
    return config


async def one(clients: list[RouterClient], names: list[str], result: Result, prompt: str, deadline: float,
              faults: Faults | None, start: float) -> None:
    request = router_pb2.GenerateRequest(prompt=prompt, sampling=sampling_params(
        max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()

    async def stream():
        async for chunk in clients[result.router].stream(request, priority=result.priority):
            if chunk.token_ids and result.ttft_ms != result.ttft_ms:     # NaN: no token yet
                result.ttft_ms = (time.perf_counter() - started) * 1000
            result.text += chunk.text
            result.tokens += chunk.token_ids
            if chunk.finish_reason:
                result.status, result.request_id = "completed", chunk.request_id

    for attempt in range(RETRIES + 1):
        attempt_at = time.monotonic() - start
        try:
            await asyncio.wait_for(stream(), max(1.0, deadline - (time.perf_counter() - started)))
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                result.status, result.detail = "rejected", f"{exc.code().name}: {exc.details()}"
                return
            if faults is not None and attempt < RETRIES and \
                    faults.router_killed(names[result.router], attempt_at - RECONNECT_GRACE_S):
                result.cut_by_router += 1       # its router died: retry on the other, from the start
                result.router, result.text, result.ttft_ms = 1 - result.router, "", float("nan")
                result.tokens = []
                continue
            result.status, result.detail = "failed", f"{exc.code().name}: {exc.details()}"
            return
        except asyncio.TimeoutError:
            result.detail = f"no final status within {deadline:.0f} s"
            return


async def reference_runs(address: str, prompts: list[str]) -> list[Result]:
    async with RouterClient(address) as client:
        results = [Result(i, "medium", 0.0, 0) for i in range(len(prompts))]
        await asyncio.gather(*(one([client], ["router"], r, prompts[r.prompt], 300, None, 0.0) for r in results))
    assert all(r.status == "completed" for r in results), [r.detail for r in results]
    return results


async def counters(cluster: LocalCluster, name: str) -> tuple[int, int]:
    """(failovers, migrations) a scheduler or a router has counted so far."""
    try:
        if name.endswith("/scheduler"):
            return (await cluster.pool_stats(name.split("/")[0])).failovers, 0
        address = cluster.router_addresses[0 if name == "router" else 1]
        async with grpc.aio.insecure_channel(address) as channel:
            return 0, (await router_pb2_grpc.RouterStub(channel).Stats(router_pb2.StatsRequest(), timeout=5)).migrations
    except grpc.aio.AioRpcError:
        return 0, 0        # it may be the one a fault just stopped: its count is lost with it


async def load(cluster: LocalCluster, prompts: list[str], args, kinds: list[str], bar):
    rng = random.Random(args.seed)
    faults = Faults(cluster, kinds, args.every, restart_after=args.restart_after)
    memory = MemoryWatch(cluster)
    start = time.monotonic()
    until = start + args.minutes * 60
    tasks_in_background = [asyncio.create_task(memory.run(start))]
    if kinds:
        tasks_in_background.append(asyncio.create_task(
            faults.run(start, args.calm, args.minutes * 60, lambda name: counters(cluster, name))))
    names = ["router", *(r.name for r in cluster.replicas)]
    results, tasks = [], []
    async with RouterClient(cluster.router_addresses[0]) as first, RouterClient(cluster.router_addresses[1]) as second:
        i = 0
        while time.monotonic() < until:
            result = Result(i % len(prompts), PRIORITIES[i % 3], time.monotonic() - start, i % 2)
            results.append(result)
            task = asyncio.create_task(one([first, second], names, result, prompts[result.prompt],
                                           args.deadline, faults, start))
            task.add_done_callback(lambda _: bar.update())
            tasks.append(task)
            i += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    for task in tasks_in_background:
        task.cancel()
    return results, faults, memory


def unbilled(store_url: str, completed: list[Result]) -> list[str]:
    store = Store(store_url)
    try:
        rows = {r["request_id"]: r for r in store.ledger_rows()}
    finally:
        store.close()
    return [r.request_id for r in completed if r.request_id not in rows
            or rows[r.request_id]["outcome"] != "completed" or rows[r.request_id]["completion_tokens"] != OUTPUT_TOKENS]


def in_namespace(argv: list[str]) -> int | None:
    """Run this benchmark again inside a network namespace of its own (for loss and partitions);
    None when that is not possible here (the reason is reported by the run itself)."""
    if os.environ.get(NETNS_ENV) or network_unavailable():
        return None
    name = f"qos-chaos-{os.getpid()}"
    if make_namespace(name):
        return None
    child = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, *argv], env={**os.environ, NETNS_ENV: name})
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())      # stopped: the run stops, the namespace goes
    try:
        return child.wait()
    except KeyboardInterrupt:
        return child.wait()
    finally:
        subprocess.run(["ip", "netns", "del", name])


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--minutes", type=float, help="load length (default 5; 20 with --soak)")
    parser.add_argument("--soak", action="store_true", help=f"{SOAK_MINUTES:g} minutes, faults that kill nothing")
    parser.add_argument("--faults", help=f"comma-separated kinds, in turn (default: {','.join(KINDS)}; "
                                         f"with --soak: {','.join(SOAK_KINDS)}); 'none' for none")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--every", type=float, help="seconds between faults (default 20; 60 with --soak)")
    parser.add_argument("--restart-after", type=float, default=2.0)
    parser.add_argument("--calm", type=float, default=30.0, help="seconds without faults first")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds before a request counts as lost")
    parser.add_argument("--model", help="model folder (default: the random-weight bench model)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="the workers' dtype (default: the host's)")
    parser.add_argument("--plot", type=Path, help="write every service's resident memory over the run as a PNG")
    args = parser.parse_args()
    if (code := in_namespace(sys.argv)) is not None:
        sys.exit(code)
    args.minutes = args.minutes or (SOAK_MINUTES if args.soak else 5.0)
    args.every = args.every or (60.0 if args.soak else 20.0)
    kinds = list(SOAK_KINDS if args.soak else KINDS) if args.faults is None else \
        [k for k in args.faults.split(",") if k and k != "none"]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown fault kinds {unknown}; choose from {', '.join(KINDS)}")
    why_not = network_unavailable()
    if why_not:
        kinds = [k for k in kinds if k not in NETWORK_KINDS]

    model = model_or_bench(args.model)
    tokenizer = TextTokenizer.from_model_dir(model)
    rng = random.Random(args.seed)
    prompts = [text_of_tokens(tokenizer, rng, rng.randint(48, 256))[0] for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="qos-chaos-") as folder:
        store_url = f"sqlite:///{folder}/store.db"
        config = cluster_config(model, store_url, args.dtype)
        every_worker = [(pool.name, i) for pool in config.pools for i in range(len(pool.workers))]
        with ProxiedCluster(config, every_worker, quiet=True) as cluster:
            reference = asyncio.run(reference_runs(cluster.router_address, prompts))
            dtype = {m.dtype for m in asyncio.run(cluster.pool_stats()).members if m.connected}.pop()
            with progress(int(args.minutes * 60 * args.rate), "chaos") as bar:
                results, faults, memory = asyncio.run(load(cluster, prompts, args, kinds, bar))
            time.sleep(2 * cluster.config.billing.flush_seconds)
            live = [asyncio.run(counters(cluster, name)) for name in
                    ["router", *(r.name for r in cluster.replicas), *(f"{p}/scheduler" for p in POOLS)]]
        completed = [r for r in results if r.status == "completed"]
        missing = unbilled(store_url, completed)
    prompt_ids = [tokenizer.encode(p) for p in prompts]       # as the scheduler tokenizes a prompt
    print(f"checking {len(completed)} streams against {model} in {dtype} ...")
    continuations = {"model": Path(model).name, **continuity(GreedyChecker(model, dtype), [
        (prompt_ids[r.prompt], reference[r.prompt].tokens, r.tokens) for r in completed])}
    report(args, results, completed, reference, faults, memory, live, missing, why_not, continuations)


def report(args, results, completed, reference, faults, memory, live, missing, why_not, continuations) -> None:
    mismatched = [r for r in completed if r.text != reference[r.prompt].text]
    first_fault = faults.log[0].at if faults.log else float("inf")
    high = [r for r in completed if r.priority == "high"]
    warm_up = 120.0 if args.soak else args.calm
    rss = memory.growth(after=warm_up, span=args.minutes * 60 / 2)
    grower = max(rss, key=lambda name: rss[name]["growth_pct"], default="")
    growth = rss[grower]["growth_pct"] if grower else None
    out = {
        "submitted": len(results), "completed": len(completed),
        **{s: sum(1 for r in results if r.status == s) for s in ("rejected", "failed", "lost")},
        "failed_on_killed_router": sum(r.cut_by_router for r in results),
        "migrated": faults.migrations + sum(m for _, m in live),
        "failovers": faults.failovers + sum(f for f, _ in live),
        "texts_checked": len(completed), "texts_mismatched": len(mismatched), "unbilled": len(missing),
        **continuations, "batch_invariant": texts_equal_undisturbed(continuations["dtype"]),
        "worker_kills": faults.count("kill-worker"), "scheduler_kills": faults.count("kill-scheduler"),
        "router_kills": faults.count("kill-router"), "hangs": faults.count("hang"),
        "losses": faults.count("loss"), "partitions": faults.count("partition"), "delays": faults.count("delay"),
        "network_faults": why_not or "in a network namespace of the benchmark's own (iptables)",
        "faults": [e.label() for e in faults.log],
        "soak_minutes": args.minutes if args.soak else 0.0,
        "rss_growth_pct": growth, "rss_growth_process": grower, "rss": rss,
        "high_p99_ttft_ms_calm": quantile([r.ttft_ms for r in high if r.sent_at < first_fault], 0.99),
        "high_p99_ttft_ms_faults": quantile([r.ttft_ms for r in high if r.sent_at >= first_fault], 0.99),
        "minutes": args.minutes, "rate": args.rate, "every": args.every, "machine": machine(),
        "rss_series": memory.labelled()}
    print(f"\n{args.minutes:g} min at {args.rate:g} req/s, {len(faults.log)} faults; {machine()}")
    for key in ("submitted", "completed", "rejected", "failed", "lost", "failed_on_killed_router", "migrated",
                "failovers", "continuations_checked", "continuations_broken", "texts_checked", "texts_mismatched",
                "unbilled", "worker_kills", "scheduler_kills",
                "router_kills", "hangs", "losses", "partitions", "delays"):
        print(f"  {key:<24}{out[key]:>8}")
    if why_not:
        print(f"  loss and partitions left out: {why_not}")
    growth_text = "n/a (no process ran long enough unrestarted)" if growth is None else f"{growth:.1f}% ({grower})"
    print(f"  largest resident-memory growth: {growth_text}")
    print(f"  High P99 TTFT: {out['high_p99_ttft_ms_calm']:.0f} ms before the faults, "
          f"{out['high_p99_ttft_ms_faults']:.0f} ms with them")
    print("  faults: " + ", ".join(out["faults"]))
    for r in [r for r in results if r.status in ("failed", "lost")][:5]:
        print(f"  {r.status} at {r.sent_at:.0f}s ({r.priority}): {r.detail}")
    checks = {"lost = 0": not out["lost"], "failed = 0": not out["failed"],
              "continuations_broken = 0": not out["continuations_broken"], "unbilled = 0": not missing}
    if out["batch_invariant"]:
        checks["texts_mismatched = 0 (batch-invariant workers)"] = not mismatched
    else:
        print(f"  {out['dtype']}: {out['texts_diverged']} texts parted from the fault-free run's "
              f"(first at token {out['first_divergence_token_min']}); equal texts are promised only "
              f"where the workers are batch-invariant")
    if args.soak:
        checks["rss_growth_pct <= 10"] = growth is not None and growth <= 10
    print("targets: " + ", ".join(f"{k} {'met' if ok else 'NOT met'}" for k, ok in checks.items()))
    write_json(args.json, out)
    if args.plot:
        plot_memory(args.plot, out["rss_series"], faults.log, warm_up,
                    f"chaos{' soak' if args.soak else ''}: {args.minutes:g} min at {args.rate:g} req/s, "
                    f"{len(faults.log)} faults; {machine()}")
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
