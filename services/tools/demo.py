"""`qos-serve demo`: start a local cluster, send a mixed-priority burst, report, shut down.

Low (batch: long documents to summarise) and Medium (ordinary questions) requests arrive at once;
High (short chat) requests arrive a moment later, in the middle of the burst. Every answer is
real SmolLM2 output; the table shows what each priority experienced.
"""
from __future__ import annotations

import asyncio
import time

import grpc

from services.common.config import ClusterConfig, RouterConfig, SchedulerConfig, WorkerConfig, single_pool
from services.common.config_file import load_config
from services.common.percentile import percentile
from services.common.priority import LABELS
from services.local.cluster import LocalCluster
from services.tools.client import RouterClient, chat_request, sampling_params

DOCUMENT = ("The city council met on Tuesday to discuss the new public library. Residents asked for "
            "longer opening hours, more study rooms and a larger children's section. The architect "
            "presented two designs: one keeps the old facade, the other replaces it with glass. ")
PROMPTS = {
    "high": ["Hi! How are you today?", "What is the capital of Japan?", "Say hello in French.",
             "What is 12 times 12?", "Name a fruit that is yellow.", "What day comes after Monday?"],
    "medium": ["Explain what a database index is.", "Give me three tips for better sleep.",
               "What is the difference between weather and climate?",
               "How does a bicycle stay upright?", "Why is the ocean salty?",
               "What does a compiler do?"],
    "low": [f"Summarise this report in detail:\n\n{DOCUMENT * 4}",
            f"List every decision mentioned in this text:\n\n{DOCUMENT * 4}",
            f"Rewrite this text for a newspaper:\n\n{DOCUMENT * 4}",
            f"Translate the key points of this text into simple English:\n\n{DOCUMENT * 4}",
            f"Write questions a resident might ask about this:\n\n{DOCUMENT * 4}",
            f"Explain the pros and cons in this text:\n\n{DOCUMENT * 4}"],
}
MAX_TOKENS = {"high": 32, "medium": 48, "low": 64}
HIGH_DELAY_SECONDS = 0.3
NAN = float("nan")


def demo_config(policy: str) -> ClusterConfig:
    # Free ports, so the demo never collides with a running `qos-serve up`. A 128-token step
    # budget keeps steps short on 2 CPU cores, so a High arrival waits little for the step in flight.
    return single_pool(router=RouterConfig(port=0, http_port=0),
                       scheduler=SchedulerConfig(port=0, policy=policy, max_step_tokens=128),
                       workers=[WorkerConfig(port=0, threads=2, kv_cache_mb=256)])


async def one(client: RouterClient, priority: str, prompt: str, delay: float):
    await asyncio.sleep(delay)
    request = chat_request(prompt, sampling_params(max_tokens=MAX_TOKENS[priority], temperature=0.0))
    try:
        return priority, prompt, await client.generate(request, priority=priority), None
    except grpc.aio.AioRpcError as exc:
        return priority, prompt, None, f"{exc.code().name}: {exc.details()}"


async def burst(address: str, per_priority: int):
    async with RouterClient(address) as client:
        tasks = []
        for priority in ("low", "medium", "high"):
            prompts = PROMPTS[priority]
            delay = HIGH_DELAY_SECONDS if priority == "high" else 0.0
            tasks += [one(client, priority, prompts[i % len(prompts)], delay) for i in range(per_priority)]
        started = time.perf_counter()
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - started


def report(results, elapsed: float) -> None:
    shown = set()
    for priority, prompt, answer, error in results:
        if priority in shown or answer is None:
            continue
        shown.add(priority)
        head = prompt if len(prompt) < 80 else prompt[:77] + "..."
        print(f"[{priority}] > {head}\n{answer.text.strip()}\n")
    print(f"{'priority':<8} {'ok':>4} {'failed':>6} {'TTFT p50':>9} {'p95':>7} {'p99':>7} "
          f"{'e2e p50':>8} {'p99':>7} {'tokens':>7}")
    for priority in LABELS:
        mine = [r for r in results if r[0] == priority]
        ok = [a for _, _, a, e in mine if a is not None]
        ttft = [a.ttft_ms for a in ok]
        e2e = [a.e2e_ms for a in ok]
        print(f"{priority:<8} {len(ok):>4} {len(mine) - len(ok):>6} {percentile(ttft, .5, NAN):>7.0f}ms "
              f"{percentile(ttft, .95, NAN):>5.0f}ms {percentile(ttft, .99, NAN):>5.0f}ms "
              f"{percentile(e2e, .5, NAN):>6.0f}ms {percentile(e2e, .99, NAN):>5.0f}ms "
              f"{sum(len(a.token_ids) for a in ok):>7}")
    for priority, _, _, error in results:
        if error:
            print(f"[{priority}] failed: {error}")
    total = sum(len(a.token_ids) for _, _, a, _ in results if a)
    print(f"\n{len(results)} requests, {total} output tokens in {elapsed:.1f} s "
          f"({total / elapsed:.1f} tokens/s). Latencies are measured by the client.")


def run_demo(args) -> int:
    config = load_config(args.config) if args.config else demo_config(args.policy)
    print("starting a local cluster (router, scheduler, CPU worker)...", flush=True)
    started = time.perf_counter()
    with LocalCluster(config, quiet=True, supervise=True) as cluster:
        print(f"cluster ready in {time.perf_counter() - started:.1f} s: router {cluster.router_address}, "
              f"policy {config.pools[0].scheduler.policy}\n", flush=True)
        results, elapsed = asyncio.run(burst(cluster.router_address, args.requests_per_priority))
        report(results, elapsed)
        print("\nstopping the cluster...", flush=True)
    print("cluster stopped; no process left running.")
    return 0 if all(error is None for *_, error in results) else 1
