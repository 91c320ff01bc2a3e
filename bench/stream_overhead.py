#!/usr/bin/env python
"""What serving through the whole stack costs against the engine alone: N concurrent streams
decoding T tokens each (greedy, no early end), first straight through the engine in this
process (BatchRunner, 1 thread), then through a local cluster (router, scheduler and one worker
as separate processes, 1 worker thread, gRPC streams from this process), same prompts.

Besides tokens per second both ways and their ratio, it reads the worker's own metrics: the mean
engine step and `qos_worker_plan_wait_seconds`, the worker's wait between answering a step and
receiving the next plan (the scheduler's turn: postprocessing, planning, and whatever else its
event loop runs first, plus the transport both ways), as a share of the worker's time.

    python bench/stream_overhead.py [--streams N] [--tokens T] [--rounds R] [--model DIR|default]
                                    [--json PATH]

Default model: the random-weight bench model (bench/harness.py model_or_bench). On 2 cores the
cluster's router, scheduler and this client share the second core while the worker uses one.
"""
from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import machine, make_parser, model_or_bench, write_json  # noqa: E402
from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402
from services.tools.client import RouterClient, chat_request, sampling_params  # noqa: E402


def prompt(i: int) -> str:
    return f"Tell me about {i}."


def engine_alone(model: str, streams: int, tokens: int) -> float:
    """Tokens per second of bench/engine_throughput.py's BatchRunner run (greedy, exactly `tokens`
    each, the same step budget as the scheduler's default) over the same prompts, one thread."""
    from bench.engine_workload import Request, run_engine
    from services.engine.engine import Engine, EngineConfig
    tokenizer = TextTokenizer.from_model_dir(model)
    engine = Engine(EngineConfig(model_dir=model, num_threads=1, kv_cache_bytes=512 * 2**20))
    batch = [Request(tokenizer.encode_chat([{"role": "user", "content": prompt(i)}]), tokens)
             for i in range(streams)]
    run_engine(engine, batch[:2], max_running=2)                      # warm-up
    seconds, _ = run_engine(engine, batch, max_running=streams)
    return streams * tokens / seconds


def worker_metrics(port: int) -> dict[str, float]:
    """The worker's Prometheus sums and counts this benchmark reads."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = ("qos_worker_step_seconds_sum", "qos_worker_step_seconds_count",
              "qos_worker_plan_wait_seconds_sum", "qos_worker_plan_wait_seconds_count")
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            values[name] = float(value)
    return values


def through_the_stack(model: str, streams: int, tokens: int, rounds: int) -> dict:
    config = single_pool(router=RouterConfig(port=0, http_port=0),
                         scheduler=SchedulerConfig(port=0, max_running=streams),
                         workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=512, metrics_port=0)], model=model)
    with LocalCluster(config, quiet=True) as cluster:
        port = cluster.config.pools[0].workers[0].metrics_port

        async def go() -> list[float]:
            async with RouterClient(cluster.router_address) as client:
                await client.generate(chat_request("warm up", sampling_params(max_tokens=8, ignore_eos=True)))
                rates = []
                for r in range(rounds):
                    started = time.perf_counter()
                    answers = await asyncio.gather(*[client.generate(chat_request(prompt(i), sampling_params(
                        max_tokens=tokens, temperature=0.0, ignore_eos=True)), priority="low")
                        for i in range(streams)])
                    rates.append(sum(len(a.token_ids) for a in answers) / (time.perf_counter() - started))
                    print(f"  round {r + 1}/{rounds}: {rates[-1]:.0f} tok/s through the stack", file=sys.stderr)
                return rates

        before = worker_metrics(port)
        rates = asyncio.run(go())
        after = worker_metrics(port)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    step_ms = 1000 * delta["qos_worker_step_seconds_sum"] / max(delta["qos_worker_step_seconds_count"], 1)
    wait_ms = 1000 * delta["qos_worker_plan_wait_seconds_sum"] / max(delta["qos_worker_plan_wait_seconds_count"], 1)
    return {"tok_s": sum(rates) / len(rates), "rounds_tok_s": rates, "worker_step_ms": step_ms,
            "worker_plan_wait_ms": wait_ms, "plan_wait_share": wait_ms / (step_ms + wait_ms)}


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=None,
                        help='a model folder, or "default" (SmolLM2); default: the bench model')
    args = parser.parse_args()
    model = model_or_bench(args.model)

    print(f"engine alone: {args.streams} sequences x {args.tokens} tokens ...", file=sys.stderr)
    alone = engine_alone(model, args.streams, args.tokens)
    print(f"through the stack: {args.streams} streams x {args.tokens} tokens, {args.rounds} rounds ...",
          file=sys.stderr)
    stack = through_the_stack(model, args.streams, args.tokens, args.rounds)
    print(f"{args.streams} streams x {args.tokens} tokens on {Path(model).name}; {machine()}")
    print(f"engine alone          {alone:8.0f} tok/s")
    print(f"through the stack     {stack['tok_s']:8.0f} tok/s   ({stack['tok_s'] / alone:.2f}x the engine alone)")
    print(f"worker: mean step {stack['worker_step_ms']:.1f} ms, mean wait for the next plan "
          f"{stack['worker_plan_wait_ms']:.1f} ms ({100 * stack['plan_wait_share']:.0f}% of its time)")
    extra = {f"stack_{k}": v for k, v in stack.items() if k != "tok_s"}
    write_json(args.json, {"streams": args.streams, "tokens": args.tokens, "model": Path(model).name,
                           "engine_alone_tok_s": alone, "stack_tok_s": stack["tok_s"],
                           "stack_over_engine": stack["tok_s"] / alone, **extra})


if __name__ == "__main__":
    main()
