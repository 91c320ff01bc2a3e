#!/usr/bin/env python
"""Replay a request trace against a cluster's OpenAI-compatible HTTP front and measure its prefix
cache against what an ideal cache would have served of the same trace.

    python bench/trace_replay.py --trace T.jsonl --local [--model default] [--config C.toml]
    python bench/trace_replay.py --trace T.jsonl --url http://HOST:8000 [--api-key KEY]
                                 [--router HOST:50051 | --pool-tokens N --block-size 16]
    [--requests 600] [--duration S] [--skip N] [--speed 2] [--tokens-per-hash 4|auto]
    [--classes round-robin|lengths|session] [--json PATH]

--local starts a cluster of `qos-serve up`'s defaults (or --config's) on free ports serving
--model and stops it after; --url targets one already running (--api-key, default $QOS_API_KEY,
sent as a bearer token). --model's tokenizer builds the prompts in both cases.

Trace (bench/trace_workload.py): Mooncake's JSONL (timestamp ms, input_length, output_length,
hash_ids of --block-tokens tokens each) or Azure's CSV (TIMESTAMP, ContextTokens,
GeneratedTokens: no hash ids, so every request gets blocks of its own and nothing is shared).
Rows --skip.. , at most --requests, within --duration seconds of trace time; sent at the trace's
times divided by --speed, each as a streamed /v1/completions (greedy, ignore_eos) with its class
in x-priority (--classes; default round-robin).

Prompts (bench/trace_prompts.py): each hash id is the same run of --tokens-per-hash tokens
wherever it appears, so shared hash ids are shared token prefixes. Lengths are both scaled by
tokens_per_hash / block_tokens; "auto" (default) takes the most tokens per hash id at which every
request's prompt and output fit the model's context (/v1/models max_model_len); with a number
given, a prompt that would not fit is cut from its end and counted as truncated.

Reported (table and --json):
  served          cached over prompt tokens of the requests served (usage.prompt_tokens_details)
  bounded ideal   the same for an LRU cache of the pool's KV capacity (Router.Stats: kv blocks
                  total x block size, over the pool's workers) at the server's block size, from
                  the prompts in arrival order (bench/cache_ideal.py says what it ignores); a
                  reference, not a bound: a server whose retention is not LRU may beat it
  bounded optimum the same size of cache evicting what is next used furthest ahead (Belady):
                  the bound no eviction rule passes
  unbounded ideal the same with no limit on the cache: the trace's own prefix sharing
  and TTFT P50/P99 per class (sent -> first text event), failures by status, how late the
  client sent (send_lag_ms_max), and the share of prompt blocks whose tokens came out exactly as
  built when the whole prompt was tokenized (block_tokens_exact).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cache_ideal import ideal_share  # noqa: E402
from bench.harness import PRIORITIES, machine, make_parser, progress, quantile, write_json  # noqa: E402
from bench.http_client import HttpError, complete  # noqa: E402
from bench.trace_prompts import BlockText, exact_blocks, one_token_words  # noqa: E402
from bench.trace_workload import (CLASS_RULES, MOONCAKE_BLOCK_TOKENS, classes, fit_tokens_per_hash,  # noqa: E402
                                  read_trace, scale_lengths, select, send_times)
from services.common.tokenizer import TextTokenizer  # noqa: E402


@dataclass(slots=True, frozen=True)
class Server:
    http: str                   # host:port of the HTTP front
    tls: bool
    api_key: str
    model: str                  # the id requests name
    max_len: int                # max_model_len
    block_size: int | None      # the pool's KV block size, tokens (None: unknown)
    capacity_blocks: int | None # KV blocks over the pool's workers (None: unknown)
    workers: int | None
    dtype: str = ""             # the pool's workers' (Router.Stats), "" when unknown


@dataclass(slots=True)
class Planned:
    priority: str
    at: float                   # seconds after the replay's start
    text: str
    ids: list[int]
    output_tokens: int


@dataclass(slots=True)
class Outcome:
    priority: str
    index: int = 0              # its place in the plan
    status: str = "ok"          # "ok", or "HTTP <status> <type>" / "connection <error>"
    ttft_ms: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    send_lag_ms: float = 0.0
    text: str = ""


def get_json(url: str, api_key: str) -> dict:
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)


def discover(http: str, tls: bool, api_key: str, served_model: str | None, router: str | None,
             pool_tokens: int | None, block_size: int | None) -> Server:
    """The model and its context from /v1/models; the pool's KV capacity from Router.Stats at
    `router` (gRPC), or --pool-tokens and --block-size when given."""
    base = f"{'https' if tls else 'http'}://{http}"
    for _ in range(50):                 # a router just started lists its pools once they report
        models = get_json(f"{base}/v1/models", api_key)["data"]
        if models:
            break
        time.sleep(0.2)
    else:
        raise SystemExit(f"{base}/v1/models lists no model")
    model = next((m for m in models if m["id"] == served_model), None) if served_model else models[0]
    if model is None:
        raise SystemExit(f"{base}/v1/models has no {served_model!r}: {[m['id'] for m in models]}")
    capacity = workers = None
    dtype = ""
    if router and pool_tokens is None:
        from services.tools.stats_view import fetch
        pools = [p for p in asyncio.run(fetch(router, api_key or None)).pools
                 if p.pool in model.get("pools", [p.pool])]
        if pools:
            block_size = block_size or pools[0].block_size
            capacity = sum(p.kv_blocks_total for p in pools)
            workers = sum(p.workers for p in pools)
            dtype = ",".join(sorted({m.dtype for p in pools for m in p.members if m.dtype}))
    if pool_tokens is not None and block_size:
        capacity = pool_tokens // block_size
    return Server(http, tls, api_key, model["id"], int(model["max_model_len"]), block_size, capacity, workers, dtype)


@contextlib.contextmanager
def local_cluster(model: str, config_path: str | None, adjust=None):
    """A cluster of `qos-serve up`'s defaults (or the config file's) on free ports, changed by
    `adjust(config)` if given: yields (HTTP front, router gRPC address)."""
    from services.common.config_file import load_config
    from services.local.cluster import LocalCluster
    config = load_config(config_path)
    config.model = model
    if adjust is not None:
        adjust(config)
    config.router.port, config.router.http_port = 0, 0
    for pool in config.pools:
        pool.scheduler.port = 0
        for worker in pool.workers:
            worker.port = 0
    with LocalCluster(config, quiet=True) as cluster:
        yield cluster.router_http_addresses[0], cluster.router_address


async def replay(server: Server, plan: list[Planned], bar) -> list[Outcome]:
    start, outcomes = time.monotonic(), []
    prompt = cached = 0

    async def one(index: int, p: Planned) -> None:
        nonlocal prompt, cached
        await asyncio.sleep(max(0.0, start + p.at - time.monotonic()))
        outcome = Outcome(p.priority, index, send_lag_ms=max(0.0, time.monotonic() - start - p.at) * 1000)
        try:
            answer = await complete(server.http, server.model, p.text, p.output_tokens, p.priority,
                                    api_key=server.api_key, tls=server.tls, ignore_eos=True)
            outcome.ttft_ms, outcome.prompt_tokens = answer.ttft_ms, answer.prompt_tokens
            outcome.cached_tokens, outcome.text = answer.cached_tokens, answer.text
            prompt, cached = prompt + answer.prompt_tokens, cached + answer.cached_tokens
        except HttpError as exc:
            outcome.status = f"HTTP {exc.status} {exc.code or exc.type}"
        except OSError as exc:
            outcome.status = f"connection {type(exc).__name__}"
        outcomes.append(outcome)
        failed = sum(o.status != "ok" for o in outcomes)
        bar.set_postfix_str(f"cached {cached / prompt if prompt else 0:.1%}, failed {failed}", refresh=False)
        bar.update()

    await asyncio.gather(*(one(i, p) for i, p in enumerate(plan)))
    return sorted(outcomes, key=lambda o: o.index)


def share(part: int, whole: int) -> float:
    return part / whole if whole else math.nan


def summarise(outcomes: list[Outcome]) -> dict:
    ok = [o for o in outcomes if o.status == "ok"]
    by_class = {}
    for priority in PRIORITIES:
        mine = [o for o in outcomes if o.priority == priority]
        served = [o for o in mine if o.status == "ok"]
        by_class[priority] = {
            "requests": len(mine), "ok": len(served),
            "ttft_p50_ms": quantile([o.ttft_ms for o in served], 0.5),
            "ttft_p99_ms": quantile([o.ttft_ms for o in served], 0.99),
            "served_cached_share": share(sum(o.cached_tokens for o in served), sum(o.prompt_tokens for o in served))}
    prompt, cached = sum(o.prompt_tokens for o in ok), sum(o.cached_tokens for o in ok)
    return {"requests": len(outcomes), "ok": len(ok), "prompt_tokens": prompt, "cached_tokens": cached,
            "prefill_tokens": prompt - cached, "served_cached_share": share(cached, prompt),
            "classes": by_class, "failures": dict(Counter(o.status for o in outcomes if o.status != "ok")),
            "send_lag_ms_max": max((o.send_lag_ms for o in outcomes), default=0.0)}


def print_report(result: dict) -> None:
    s, t = result["server"], result["trace"]
    print(f"\n{t['file']} ({t['format']}): {result['requests']} requests over {t['span_s']:.0f} s of trace, "
          f"sent in {result['replay_s']:.0f} s (speed {t['speed']:g}); {t['tokens_per_hash']} tokens per hash id "
          f"({t['block_tokens']} in the trace), {t['truncated']} prompts truncated; classes {t['classes']}")
    print(f"model {s['model']} (context {s['max_len']}); pool {s['capacity_blocks']} KV blocks x {s['block_size']} "
          f"tokens over {s['workers']} worker(s) ({s['dtype'] or 'dtype unknown'}); prompt blocks exact after tokenizing "
          f"{t['block_tokens_exact']:.1%}")
    bounded = result["bounded_ideal_share"]
    print(f"cached share of prompt tokens: served {result['served_cached_share']:.1%}, bounded ideal (LRU) "
          f"{bounded:.1%}, bounded optimum {result['bounded_optimal_share']:.1%}, unbounded ideal "
          f"{result['unbounded_ideal_share']:.1%}"
          f" (served / bounded {result['served_cached_share'] / bounded if bounded else math.nan:.0%})")
    print(f"  {'class':<8}{'requests':>9}{'ok':>6}{'TTFT P50':>10}{'P99':>9}{'cached':>8}")
    for name, c in result["classes"].items():
        print(f"  {name:<8}{c['requests']:>9}{c['ok']:>6}{c['ttft_p50_ms']:>8.0f}ms{c['ttft_p99_ms']:>7.0f}ms"
              f"{c['served_cached_share']:>8.1%}")
    failures = ", ".join(f"{k}: {v}" for k, v in result["failures"].items()) or "none"
    print(f"failures: {failures}; latest send {result['send_lag_ms_max']:.0f} ms behind the trace")


def build_plan(args, requests, server: Server, tokenizer: TextTokenizer) -> tuple[list[Planned], dict]:
    tokens_per_hash = args.tokens_per_hash
    if tokens_per_hash == "auto":
        tokens_per_hash = fit_tokens_per_hash(requests, args.block_tokens, server.max_len)
        if tokens_per_hash < 1:
            raise SystemExit(f"no request fits a context of {server.max_len} even at 1 token per hash id")
    tokens_per_hash = int(tokens_per_hash)
    blocks = BlockText(one_token_words(tokenizer), tokens_per_hash,
                       max((h for r in requests for h in r.hash_ids), default=0), args.seed)
    plan, truncated = [], 0
    for request, at, priority in zip(requests, send_times(requests, args.speed), classes(requests, args.classes)):
        lengths = scale_lengths(request, tokens_per_hash, args.block_tokens, server.max_len)
        truncated += lengths.truncated
        text, ids = blocks.prompt(request.hash_ids, lengths.prompt_tokens)
        plan.append(Planned(priority, at, text, ids, lengths.output_tokens))
    exact, total = exact_blocks(tokenizer, [(p.text, p.ids) for p in plan], tokens_per_hash)
    return plan, {"tokens_per_hash": tokens_per_hash, "truncated": truncated, "distinct_block_texts": blocks.distinct,
                  "block_tokens_exact": share(exact, total)}


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake JSONL or Azure CSV")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="start a local cluster serving --model")
    where.add_argument("--url", help="a running cluster's HTTP front, http(s)://HOST:PORT")
    parser.add_argument("--model", default="default", help="model folder ('default': SmolLM2): served with "
                        "--local, and its tokenizer builds the prompts")
    parser.add_argument("--config", help="with --local: a cluster config file instead of qos-serve up's defaults")
    parser.add_argument("--api-key", default=os.environ.get("QOS_API_KEY", ""))
    parser.add_argument("--served-model", help="the model id to request (default: the first /v1/models lists)")
    parser.add_argument("--router", help="with --url: the router's gRPC address, for the pool's KV capacity")
    parser.add_argument("--pool-tokens", type=int, help="the pool's KV capacity in tokens, instead of --router")
    parser.add_argument("--block-size", type=int, help="the server's KV block size in tokens, with --pool-tokens")
    parser.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS, help="tokens per hash id in the trace")
    parser.add_argument("--tokens-per-hash", default="auto", help="tokens per hash id sent (a number, or auto)")
    parser.add_argument("--classes", choices=sorted(CLASS_RULES), default="round-robin",
                        help="\n".join(f"{k}: {v[1]}" for k, v in CLASS_RULES.items()))
    parser.add_argument("--speed", type=float, default=1.0, help="trace time / replay time")
    parser.add_argument("--skip", type=int, default=0, help="trace rows to skip first")
    parser.add_argument("--requests", type=int, help="at most this many requests")
    parser.add_argument("--duration", type=float, help="at most this many seconds of trace time")
    args = parser.parse_args()
    trace, fmt = read_trace(args.trace, args.block_tokens)
    requests = select(trace, args.skip, args.requests, args.duration)
    if not requests:
        raise SystemExit(f"{args.trace}: no request selected")
    from services.local.cluster import resolve_model
    model = resolve_model(args.model, progress=True)
    tokenizer = TextTokenizer.from_model_dir(model)
    with contextlib.ExitStack() as stack:
        if args.local:
            http, router = stack.enter_context(local_cluster(model, args.config))
            tls = False
        else:
            parts = urlsplit(args.url)
            http, router, tls = parts.netloc, args.router, parts.scheme == "https"
        server = discover(http, tls, args.api_key, args.served_model, router, args.pool_tokens, args.block_size)
        plan, prompts = build_plan(args, requests, server, tokenizer)
        with progress(len(plan), f"replaying {args.trace.name}") as bar:
            began = time.monotonic()
            outcomes = asyncio.run(replay(server, plan, bar))
            replay_s = time.monotonic() - began
    block = server.block_size or 16
    result = {"machine": machine(),
              "trace": {"file": args.trace.name, "format": fmt, "skip": args.skip, "span_s": requests[-1].at_ms / 1000,
                        "speed": args.speed, "block_tokens": args.block_tokens, "classes": args.classes, **prompts},
              "server": {**dataclasses.asdict(server), "api_key": bool(server.api_key), "local": args.local},
              "replay_s": replay_s, **summarise(outcomes),
              "bounded_ideal_share": (ideal_share([p.ids for p in plan], block, server.capacity_blocks)
                                      if server.capacity_blocks is not None else math.nan),
              "bounded_optimal_share": (ideal_share([p.ids for p in plan], block, server.capacity_blocks, optimal=True)
                                        if server.capacity_blocks is not None else math.nan),
              "unbounded_ideal_share": ideal_share([p.ids for p in plan], block, None)}
    print_report(result)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
