#!/usr/bin/env python
"""Long documents for Low in streaming mode, beside a burst of High chats and Medium API calls.

The design's scenario, scaled to this machine: one pool, one CPU worker, the real SmolLM2-135M
(8,192-token context). Low sends --low-docs documents of --doc-tokens tokens each (32,768: four
times the context; public-domain KJV text from Debian's bible-kjv, bench/stream_perplexity.py)
asking for --low-output tokens; the pool's defaults serve them in streaming mode (Low's
long_prompts = "stream": 4 sinks + a 2,048-token window), where dense attention refuses them.
Medium sends --medium API calls (~256-token prompts) and High a Poisson stream of short chats
(--high-rate a second for --high-seconds), all from the start.

    1. idle     12 High chats one at a time on the idle cluster: High's idle TTFT (P50)
    2. burst    the three classes together: every Low completes?  Low's KV peak (share of the
                pool's blocks, cap 30%), High's P99 TTFT under the burst over its idle P50
    3. lengths  one document at a time, alone, at --lengths tokens: Low's tokens a second
                (prompt + output over end to end) in streaming mode, and dense where it fits
    4. quality  perplexity dense / sinks / window only, from bench/stream_perplexity.py: run here
                (--perplexity run, ~25 min) or read from its committed JSON (the default; the
                figures depend on model, text and window only, not on this host's load)

    python bench/long_context.py --json bench/results/long_context.json [--plot PNG]

JSON keys: low_completed, low_submitted, low_kv_peak (share of the pool), low_kv_cap,
high_p99_ttft_ms, high_idle_p50_ms, high_p99_over_idle, the ppl_* keys of bench/stream_perplexity.py,
tok_s_by_length ([tokens, tok/s] in streaming mode), tok_s_by_length_dense.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import machine, make_parser, model_or_bench, progress, quantile, write_json  # noqa: E402
from bench.loadgen import Front, Job, run_clients  # noqa: E402
from bench.qos_burst import idle_high_ttft  # noqa: E402
from bench.stream_perplexity import kjv_text  # noqa: E402
from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool  # noqa: E402
from services.common.priority import priority_name  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402
from services.tools.client import RouterClient, sampling_params  # noqa: E402

PERPLEXITY_JSON = Path(__file__).resolve().parent / "results" / "stream_perplexity.json"
CHATS = ["What is {n} plus {n}?", "Name {n} animals.", "Write a sentence about the number {n}.",
         "Give {n} reasons to learn Python.", "Count from {n} to {m}."]


class Documents:
    """Spans of the KJV text as prompts of about a given token count (decoded from its tokens,
    so a span re-tokenizes to within a few tokens of the count)."""

    def __init__(self, model_dir: str):
        self.tokenizer = TextTokenizer.from_model_dir(model_dir)
        text = kjv_text()
        self.ids = self.tokenizer.encode(text + " " + text)    # room for several 32K-token spans

    def take(self, tokens: int, offset: int) -> str:
        start = offset % max(1, len(self.ids) - tokens)
        return "Summarise the following text.\n\n" + self.tokenizer.decode(self.ids[start:start + tokens])


def cluster_config(model: str, args):
    return single_pool(model=model, router=RouterConfig(port=0, http_port=0),
                       scheduler=SchedulerConfig(port=0, max_step_tokens=args.max_step_tokens,
                                                 max_running=args.max_running),
                       workers=[WorkerConfig(port=0, threads=args.threads, kv_cache_mb=args.kv_cache_mb)])


def burst_jobs(docs: Documents, args) -> list[Job]:
    rng = random.Random(args.seed)
    jobs = [Job("low", docs.take(args.doc_tokens, i * 9_973), args.doc_tokens, args.low_output, at=0.0)
            for i in range(args.low_docs)]
    for i in range(args.medium):
        jobs.append(Job("medium", docs.take(256, 50_000 + i * 997), 256, 32, at=rng.uniform(0, args.high_seconds)))
    at = 0.0
    while True:
        at += rng.expovariate(args.high_rate)
        if at >= args.high_seconds:
            break
        chat = rng.choice(CHATS).format(n=rng.randint(2, 9), m=rng.randint(10, 20))
        jobs.append(Job("high", chat, 12, 16, at=at))
    return jobs


def run_burst(cluster: LocalCluster, jobs: list[Job]) -> dict:
    front = Front.of("grpc", cluster)
    idle = asyncio.run(idle_high_ttft(front, [j for j in jobs if j.priority == "high"]))
    with progress(len(jobs), "burst") as bar:
        outcomes, _ = asyncio.run(run_clients(front, jobs, on_progress=bar.update))
    stats = asyncio.run(cluster.pool_stats())
    low = next(c for c in stats.classes if priority_name(c.priority) == "low")
    by = {p: [o for o in outcomes if o.priority == p] for p in ("high", "medium", "low")}
    high_ttft = [o.ttft_ms for o in by["high"] if o.ok]
    failures = sorted({f"{o.priority}: {o.code} {o.detail[:120]}" for o in outcomes if not o.ok})
    return {
        "low_submitted": len(by["low"]), "low_completed": sum(o.ok for o in by["low"]),
        "low_kv_peak": low.kv_blocks_peak / stats.kv_blocks_total, "low_kv_cap": low.kv_cap,
        "low_kv_peak_blocks": low.kv_blocks_peak, "kv_blocks_total": stats.kv_blocks_total,
        "low_e2e_s": [round(o.e2e_ms / 1000, 1) for o in by["low"] if o.ok],
        "medium_submitted": len(by["medium"]), "medium_completed": sum(o.ok for o in by["medium"]),
        "high_submitted": len(by["high"]), "high_completed": len(high_ttft),
        "high_p50_ttft_ms": quantile(high_ttft, 0.5), "high_p99_ttft_ms": quantile(high_ttft, 0.99),
        "high_idle_p50_ms": idle["idle_high_p50_ttft_ms"],
        "high_p99_over_idle": quantile(high_ttft, 0.99) / idle["idle_high_p50_ttft_ms"],
        "preemptions": stats.preemptions, "failures": failures,
    }


async def one_document(cluster: LocalCluster, prompt: str, output: int, mode: str) -> tuple[int, float]:
    """(prompt tokens, tokens a second end to end) of one Low document sent alone."""
    async with RouterClient(cluster.router_address) as client:
        request = sampling_params(max_tokens=output, temperature=0.0, ignore_eos=True)
        from services.common.proto.qos.v1 import router_pb2
        answer = await client.generate(router_pb2.GenerateRequest(prompt=prompt, sampling=request),
                                       priority="low", context_mode=mode)
    if (answer.streaming is not None) != (mode == "streaming"):
        raise RuntimeError(f"asked for {mode}, usage says streaming={answer.streaming}")
    return answer.prompt_tokens, (answer.prompt_tokens + len(answer.token_ids)) / (answer.e2e_ms / 1000)


def run_lengths(cluster: LocalCluster, docs: Documents, args, context: int) -> dict:
    streaming, dense = [], []
    with progress(len(args.lengths), "lengths") as bar:
        for i, length in enumerate(args.lengths):
            prompt = docs.take(length, 20_000 + i * 3_001)
            tokens, rate = asyncio.run(one_document(cluster, prompt, args.low_output, "streaming"))
            streaming.append([tokens, round(rate, 1)])
            if length + args.low_output + 64 <= context:
                tokens, rate = asyncio.run(one_document(cluster, prompt, args.low_output, "dense"))
                dense.append([tokens, round(rate, 1)])
            bar.update(1)
    return {"tok_s_by_length": streaming, "tok_s_by_length_dense": dense}


def perplexity(args, model: str) -> dict:
    if args.perplexity == "run":
        from bench.stream_perplexity import measure
        result = measure(model, threads=args.threads)
        source = "measured in this run (bench/stream_perplexity.py)"
    elif PERPLEXITY_JSON.is_file():
        result = json.loads(PERPLEXITY_JSON.read_text())
        source = "read from bench/results/stream_perplexity.json"
    else:
        print(f"no {PERPLEXITY_JSON}: run bench/stream_perplexity.py first, or --perplexity run", file=sys.stderr)
        return {}
    keys = ("ppl_dense_within_context", "ppl_sinks_all_tokens", "ppl_window_only_all_tokens",
            "ppl_sinks_within_context", "ppl_window_only_within_context", "ppl_dense_past_context",
            "ppl_sinks_past_context", "ppl_window_only_past_context", "sink_tokens", "window_tokens")
    return {**{k: result[k] for k in keys if k in result}, "perplexity_source": source,
            "perplexity_tokens": result.get("tokens")}


def plot(path: Path, result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (("tok_s_by_length", "streaming (sinks + window)", "o-"),
                              ("tok_s_by_length_dense", "dense", "s--")):
        points = result.get(key) or []
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    ax.axvline(result["context"], color="grey", linestyle=":", label=f"model context ({result['context']})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("Low tokens / s (prompt + output, end to end)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"One Low document alone: {Path(result['model']).name}\n{result['machine']}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args(argv=None):
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--model", default="default", help="model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--low-docs", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=32_768)
    parser.add_argument("--low-output", type=int, default=64)
    parser.add_argument("--medium", type=int, default=40)
    parser.add_argument("--high-rate", type=float, default=0.5, help="High chats a second")
    parser.add_argument("--high-seconds", type=float, default=240.0, help="High and Medium arrive within this")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--threads", type=int, default=2, help="worker torch threads")
    parser.add_argument("--kv-cache-mb", type=int, default=1200,
                        help="the worker's KV cache (1,200 MB: 1,706 blocks of SmolLM2-135M; Low's 30%% holds "
                             "3 windows)")
    parser.add_argument("--max-step-tokens", type=int, default=256)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--perplexity", choices=["read", "run"], default="read")
    parser.add_argument("--skip", default="", help="comma-separated phases to skip: burst, lengths")
    parser.add_argument("--plot", type=Path, help="PNG of Low's tokens a second against document length")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only draw --plot from this result")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.replot:
        plot(args.plot, json.loads(args.replot.read_text()))
        return
    model = model_or_bench(args.model)
    from services.engine.config import load_model_config
    context = load_model_config(model).max_context
    docs = Documents(model)
    result = {"model": model, "context": context, "machine": machine(), "args": {
        k: v for k, v in vars(args).items() if k not in ("json", "plot")}}
    started = time.time()
    with LocalCluster(cluster_config(model, args), quiet=True) as cluster:
        if "burst" not in args.skip:
            result.update(run_burst(cluster, burst_jobs(docs, args)))
        if "lengths" not in args.skip:
            result.update(run_lengths(cluster, docs, args, context))
    result.update(perplexity(args, model))
    result["wall_s"] = round(time.time() - started, 1)
    shown = {k: v for k, v in result.items() if k not in ("machine", "args")}
    print(json.dumps(shown, indent=2, default=str))
    write_json(args.json, result)
    if args.plot and "lengths" not in args.skip:
        plot(args.plot, result)


if __name__ == "__main__":
    main()
