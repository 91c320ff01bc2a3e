#!/usr/bin/env python
"""Chaos: a steady mixed-priority load through the router while a worker or a scheduler is
SIGKILLed every --kill-every seconds (30) and restarted --restart-after seconds (2) later.
Counts what happened to every request, and checks every completed text against a fault-free run.

Cluster: router, two pools ("a", the primary, and "b"), each a scheduler and two CPU workers
(1 thread), the random-weight bench model (or --model). Victims in turn: a worker of a, the
scheduler of a, a worker of b, the scheduler of b, ... A worker's sequences are recomputed on its
pool's other worker; a dead scheduler's requests move to the other pool (router migration).

Load: --rate requests per second (Poisson), priorities in turn high / medium / low, prompts cycled
from --prompts fixed ones (48-256 tokens), greedy, 64 output tokens (the default rate keeps some
requests on every worker most of the time, so a kill nearly always hits streams in flight). The first --calm seconds have
no fault: High's TTFT then is the "without faults" figure. Every completed text must equal the
text the same prompt got before the faults began.

    python bench/chaos.py [--minutes 5] [--json PATH] [--rate 4] [--kill-every 30]

Writes: submitted, completed, rejected (RESOURCE_EXHAUSTED: a limit, not a fault), failed (any
other error), lost (no final chunk and no error within --deadline), migrated (router stats),
failovers (schedulers' recomputations), texts_checked, texts_mismatched, high_p99_ttft_ms_calm,
high_p99_ttft_ms_faults. Targets: lost = 0, failed = 0, texts_mismatched = 0.
"""
from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.harness import PRIORITIES, machine, make_parser, model_or_bench, progress, quantile, write_json  # noqa: E402
from bench.qos_workloads import text_of_tokens  # noqa: E402
from services.common.config import ClusterConfig, PoolConfig, RouterConfig, SchedulerConfig, WorkerConfig  # noqa: E402
from services.common.proto.qos.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402
from services.tools.client import RouterClient, sampling_params  # noqa: E402

OUTPUT_TOKENS = 64
POOLS = ("a", "b")


@dataclass(slots=True)
class Result:
    prompt: int
    priority: str
    sent_at: float
    status: str = "lost"          # completed, rejected, failed, lost
    text: str = ""
    ttft_ms: float = float("nan")
    detail: str = ""


def cluster_config(model: str) -> ClusterConfig:
    def pool(name: str) -> PoolConfig:
        return PoolConfig(name=name, device="cpu", primary=name == "a",
                          scheduler=SchedulerConfig(port=0, max_step_tokens=128, orphan_grace_s=20.0),
                          workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=128) for _ in range(2)])
    return ClusterConfig(model=model, router=RouterConfig(port=0, http_port=-1), pools=[pool(n) for n in POOLS])


async def one(client: RouterClient, result: Result, prompt: str, deadline: float) -> None:
    request = router_pb2.GenerateRequest(prompt=prompt, sampling=sampling_params(
        max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()

    async def stream():
        async for chunk in client.stream(request, priority=result.priority):
            if chunk.token_ids and result.ttft_ms != result.ttft_ms:     # NaN: no token yet
                result.ttft_ms = (time.perf_counter() - started) * 1000
            result.text += chunk.text
            if chunk.finish_reason:
                result.status = "completed"

    try:
        await asyncio.wait_for(stream(), deadline)
    except grpc.aio.AioRpcError as exc:
        exhausted = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        result.status, result.detail = ("rejected" if exhausted else "failed"), f"{exc.code().name}: {exc.details()}"
    except asyncio.TimeoutError:
        result.detail = f"no final status within {deadline:.0f} s"


async def reference_texts(address: str, prompts: list[str]) -> list[str]:
    async with RouterClient(address) as client:
        results = [Result(i, "medium", 0.0) for i in range(len(prompts))]
        await asyncio.gather(*(one(client, r, prompts[r.prompt], 300) for r in results))
    assert all(r.status == "completed" for r in results), [r.detail for r in results]
    return [r.text for r in results]


class Chaos:
    """Kills one process every `every` seconds, in turn, and restarts it `after` seconds later."""

    def __init__(self, cluster: LocalCluster, every: float, after: float):
        self.cluster, self.every, self.after = cluster, every, after
        victims = []
        for i in range(2):
            for pool in POOLS:
                victims += [(f"{pool}/worker-{i}", ("worker", pool, i)), (f"{pool}/scheduler", ("scheduler", pool, 0))]
        self.victims = victims
        self.log: list[tuple[float, str]] = []
        self.failovers = 0      # counted by schedulers killed since (their counters die with them)

    async def run(self, start: float, until: float) -> None:
        turn = 0
        while (at := start + self.every * (turn + 1)) < until:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            name, (kind, pool, index) = self.victims[turn % len(self.victims)]
            process = self.cluster.processes[name]
            if kind == "scheduler":
                self.failovers += await pool_failovers(self.cluster, pool)
            process.send_signal(signal.SIGKILL)
            self.log.append((time.monotonic() - start, name))
            await asyncio.get_running_loop().run_in_executor(None, process.wait)
            await asyncio.sleep(self.after)
            if kind == "worker":
                self.cluster.start_worker(pool, index)
            else:
                self.cluster.start_scheduler(pool)
            turn += 1


async def load(cluster: LocalCluster, prompts: list[str], args, bar) -> tuple[list[Result], Chaos, float]:
    rng = random.Random(args.seed)
    chaos = Chaos(cluster, args.kill_every, args.restart_after)
    start = time.monotonic()
    until = start + args.minutes * 60
    faults = asyncio.create_task(chaos.run(start + args.calm - args.kill_every, until))
    results, tasks = [], []
    async with RouterClient(cluster.router_address) as client:
        i = 0
        while time.monotonic() < until:
            result = Result(i % len(prompts), PRIORITIES[i % 3], time.monotonic() - start)
            results.append(result)
            task = asyncio.create_task(one(client, result, prompts[result.prompt], args.deadline))
            task.add_done_callback(lambda _: bar.update())
            tasks.append(task)
            i += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    faults.cancel()
    return results, chaos, start


async def router_migrations(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await router_pb2_grpc.RouterStub(channel).Stats(router_pb2.StatsRequest())).migrations


async def pool_failovers(cluster: LocalCluster, pool: str) -> int:
    return (await cluster.pool_stats(pool)).failovers


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--kill-every", type=float, default=30.0)
    parser.add_argument("--restart-after", type=float, default=2.0)
    parser.add_argument("--calm", type=float, default=30.0, help="seconds without faults first")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds before a request counts as lost")
    parser.add_argument("--model", help="model folder (default: the random-weight bench model)")
    args = parser.parse_args()
    model = model_or_bench(args.model)
    tokenizer = TextTokenizer.from_model_dir(model)
    rng = random.Random(args.seed)
    prompts = [text_of_tokens(tokenizer, rng, rng.randint(48, 256))[0] for _ in range(args.prompts)]
    with LocalCluster(cluster_config(model), quiet=True) as cluster:
        reference = asyncio.run(reference_texts(cluster.router_address, prompts))
        expected = int(args.minutes * 60 * args.rate)
        with progress(expected, "chaos") as bar:
            results, chaos, start = asyncio.run(load(cluster, prompts, args, bar))
        migrated = asyncio.run(router_migrations(cluster.router_address))
        failovers = chaos.failovers + sum(asyncio.run(pool_failovers(cluster, p)) for p in POOLS)

    completed = [r for r in results if r.status == "completed"]
    mismatched = [r for r in completed if r.text != reference[r.prompt]]
    first_fault = chaos.log[0][0] if chaos.log else float("inf")
    high = [r for r in completed if r.priority == "high"]
    report = {
        "submitted": len(results), "completed": len(completed),
        **{s: sum(1 for r in results if r.status == s) for s in ("rejected", "failed", "lost")},
        "migrated": migrated, "failovers": failovers, "texts_checked": len(completed),
        "texts_mismatched": len(mismatched), "kills": [f"{t:.0f}s {name}" for t, name in chaos.log],
        "high_p99_ttft_ms_calm": quantile([r.ttft_ms for r in high if r.sent_at < first_fault], 0.99),
        "high_p99_ttft_ms_faults": quantile([r.ttft_ms for r in high if r.sent_at >= first_fault], 0.99),
        "minutes": args.minutes, "rate": args.rate, "machine": machine()}
    print(f"\n{args.minutes:g} min at {args.rate:g} req/s, {len(chaos.log)} kills; {machine()}")
    for key in ("submitted", "completed", "rejected", "failed", "lost", "migrated", "failovers",
                "texts_checked", "texts_mismatched"):
        print(f"  {key:<18}{report[key]:>8}")
    print(f"  High P99 TTFT: {report['high_p99_ttft_ms_calm']:.0f} ms before the faults, "
          f"{report['high_p99_ttft_ms_faults']:.0f} ms with them")
    print("  kills: " + ", ".join(report["kills"]))
    for r in [r for r in results if r.status in ("failed", "lost")][:5]:
        print(f"  {r.status} at {r.sent_at:.0f}s ({r.priority}): {r.detail}")
    print(f"targets: lost = 0 {'met' if not report['lost'] else 'NOT met'}, failed = 0 "
          f"{'met' if not report['failed'] else 'NOT met'}, texts_mismatched = 0 "
          f"{'met' if not mismatched else 'NOT met'}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
