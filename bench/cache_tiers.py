#!/usr/bin/env python
"""Prefix caching off, the pool only, and the pool with a second KV tier, in one run, on the
same traces replayed the same way (bench/trace_replay.py's machinery): `qos-serve up`'s cluster
(one CPU worker) started afresh for each side, --dtype (default fp32, where a prefix read from
cached or loaded blocks holds the same numbers as one computed, so greedy texts must agree).

    python bench/cache_tiers.py [--workloads synthetic,chat,api] [--requests 300] [--tier-x 8]
                                [--json-dir bench/results]

Workloads (bench/traces/): synthetic = Mooncake's synthetic trace (512-token hash ids sent as
--tokens-per-hash tokens), conversation = Mooncake's conversation trace (the same), chat and api =
the prefix-cache bench's two workloads as traces (bench/workload_traces.py; 16-token hash ids sent
at their length). Per workload and side: the served cached share of prompt tokens, prompt tokens
computed, TTFT P50/P99 per class, failures; beside them, from the prompts alone, the bounded ideal
(an LRU cache of the pool's capacity at its block size), the bounded optimum (Belady), the LRU of
the pool and tier together, and the unbounded ideal; and every text of the pool and tier sides
compared with the side without a cache. JSON per workload: bench/results/cache_tiers_<name>.json.
Targets: pool >= 80% of the bounded ideal; pool + tier of 8x the pool >= 80% of the unbounded
ideal; High TTFT P50 >= 1.5x lower than cache off; no text mismatched.
"""
from __future__ import annotations

import asyncio
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cache_ideal import ideal_share  # noqa: E402
from bench.harness import machine, make_parser, progress, write_json  # noqa: E402
from bench.trace_replay import build_plan, discover, local_cluster, replay, summarise  # noqa: E402
from bench.trace_workload import read_trace, select  # noqa: E402
from services.common.config import DEFAULT_CPU_KV_MB  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402

TRACES = Path(__file__).resolve().parent / "traces"
# name -> (file, tokens per hash id in the file, tokens per hash id sent)
WORKLOADS = {"synthetic": ("mooncake_synthetic.jsonl", 512, 4), "conversation": ("mooncake_conversation.jsonl", 512, 4),
             "chat": ("workload_chat.jsonl", 16, 16), "api": ("workload_api.jsonl", 16, 16)}
SIDES = ("off", "pool", "tier")


def adjust(side: str, tier_x: int, dtype: str):
    def change(config) -> None:
        for pool in config.pools:
            pool.scheduler.prefix_caching = side != "off"
            for worker in pool.workers:
                worker.dtype = dtype
                if side == "tier":
                    worker.kv_tier_mb = tier_x * (worker.kv_cache_mb or DEFAULT_CPU_KV_MB)
    return change


def run_side(side: str, args, model: str, requests, tokenizer, trace_args) -> tuple[dict, list, dict, object]:
    with local_cluster(model, None, adjust(side, args.tier_x, args.dtype)) as (http, router):
        server = discover(http, False, "", None, router, None, None)
        plan, prompts = build_plan(trace_args, requests, server, tokenizer)
        with progress(len(plan), f"{trace_args.trace.name}, {side}") as bar:
            began = time.monotonic()
            outcomes = asyncio.run(replay(server, plan, bar))
            seconds = time.monotonic() - began
    return {"replay_s": seconds, **summarise(outcomes)}, outcomes, prompts, (server, plan)


def compare(base: list, other: list) -> dict:
    both = [(a.text, b.text) for a, b in zip(base, other) if a.status == b.status == "ok"]
    return {"texts_checked": len(both), "texts_mismatched": sum(a != b for a, b in both)}


def run_workload(name: str, args, model: str, tokenizer) -> dict:
    file, block_tokens, tokens_per_hash = WORKLOADS[name]
    trace_args = SimpleNamespace(trace=TRACES / file, block_tokens=block_tokens, tokens_per_hash=tokens_per_hash,
                                 speed=args.speed, classes="round-robin", seed=args.seed)
    trace, fmt = read_trace(trace_args.trace, block_tokens)
    requests = select(trace, args.skip, args.requests, args.duration)
    sides, outcomes = {}, {}
    for side in SIDES:
        sides[side], outcomes[side], prompts, (server, plan) = run_side(side, args, model, requests, tokenizer, trace_args)
    block, capacity = server.block_size or 16, server.capacity_blocks
    ids = [p.ids for p in plan]
    result = {
        "machine": machine(), "workload": name, "dtype": args.dtype, "tier_x": args.tier_x,
        "trace": {"file": file, "format": fmt, "skip": args.skip, "requests": len(requests),
                  "span_s": (requests[-1].at_ms - requests[0].at_ms) / 1000,
                  "speed": args.speed, "block_tokens": block_tokens, **prompts},
        "server": {"model": server.model, "block_size": block, "capacity_blocks": capacity, "workers": server.workers},
        **{side: sides[side] for side in SIDES},
        "bounded_ideal_share": ideal_share(ids, block, capacity),
        "bounded_optimal_share": ideal_share(ids, block, capacity, optimal=True),
        "tier_ideal_share": ideal_share(ids, block, capacity * (1 + args.tier_x)),
        "unbounded_ideal_share": ideal_share(ids, block, None),
        "pool_vs_off": compare(outcomes["off"], outcomes["pool"]),
        "tier_vs_off": compare(outcomes["off"], outcomes["tier"]),
    }
    high = {side: sides[side]["classes"]["high"]["ttft_p50_ms"] for side in SIDES}
    result["ratios"] = {
        "pool_of_bounded_ideal": sides["pool"]["served_cached_share"] / result["bounded_ideal_share"]
        if result["bounded_ideal_share"] else math.nan,
        "tier_of_unbounded_ideal": sides["tier"]["served_cached_share"] / result["unbounded_ideal_share"]
        if result["unbounded_ideal_share"] else math.nan,
        "high_ttft_p50_off_over_pool": high["off"] / high["pool"],
        "high_ttft_p50_off_over_tier": high["off"] / high["tier"]}
    return result


def report(result: dict) -> None:
    print(f"\n{result['workload']} ({result['trace']['file']}, {result['trace']['requests']} requests, "
          f"{result['dtype']}): pool {result['server']['capacity_blocks']} blocks, tier {result['tier_x']}x")
    print(f"  ideal: bounded (LRU) {result['bounded_ideal_share']:.1%}, bounded optimum "
          f"{result['bounded_optimal_share']:.1%}, pool + tier LRU {result['tier_ideal_share']:.1%}, "
          f"unbounded {result['unbounded_ideal_share']:.1%}")
    print(f"  {'side':<6}{'served':>8}{'prefill':>9}{'High P50':>10}{'P99':>8}{'failed':>8}")
    for side in SIDES:
        s = result[side]
        high = s["classes"]["high"]
        print(f"  {side:<6}{s['served_cached_share']:>8.1%}{s['prefill_tokens']:>9}{high['ttft_p50_ms']:>8.0f}ms"
              f"{high['ttft_p99_ms']:>6.0f}ms{s['requests'] - s['ok']:>8}")
    r = result["ratios"]
    print(f"  pool / bounded ideal {r['pool_of_bounded_ideal']:.0%}, tier / unbounded ideal "
          f"{r['tier_of_unbounded_ideal']:.0%}, High P50 off / tier {r['high_ttft_p50_off_over_tier']:.2f}x; "
          f"texts mismatched: pool {result['pool_vs_off']['texts_mismatched']}, "
          f"tier {result['tier_vs_off']['texts_mismatched']}")


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--workloads", default="synthetic,chat,api")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--requests", type=int, default=300, help="at most this many requests of each trace")
    parser.add_argument("--duration", type=float, help="at most this many seconds of trace time")
    parser.add_argument("--skip", type=int, default=0, help="trace rows to skip first")
    parser.add_argument("--suffix", default="", help="added to each JSON's name (cache_tiers_<workload><suffix>.json)")
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--tier-x", type=int, default=8, help="the tier's size in pools")
    parser.add_argument("--json-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    from services.local.cluster import resolve_model
    model = resolve_model(args.model, progress=True)
    tokenizer = TextTokenizer.from_model_dir(model)
    for name in args.workloads.split(","):
        result = run_workload(name, args, model, tokenizer)
        report(result)
        write_json(args.json_dir / f"cache_tiers_{name}{args.suffix}.json", result)


if __name__ == "__main__":
    main()
