#!/usr/bin/env python
"""Prefix caching off against on, in one run, on the same cluster shape: one pool, two CPU workers
(1 thread each), greedy, the random-weight bench model (or --model default for SmolLM2).

Two workloads, each run with the cache off and then on:
  chat  --users conversations (priorities High, Medium, Low in turn), 3-8 turns each; every turn
        resends the conversation so far (a system prompt all users share, every earlier message
        and answer) plus a new message of 16-48 tokens, and waits for its answer (--answer tokens)
        before the next, after --think seconds. Users start --stagger seconds apart.
  api   --api-requests calls at --api-rate per second (Poisson), priorities in turn, each one of
        --system-prompts long system prompts (--system-tokens) plus a question of 16-32 tokens.

--tenants N spreads the users and the calls over N tenants in turn (x-tenant): the chat's
conversations each stay inside a tenant, the API's system prompts are shared across tenants, and
the cache, scoped per tenant by default (router cache_scope), no longer shares across them; the
run with N > 1 against N = 1 is what isolation costs.

Reported per workload and side: prompt tokens computed (prompt tokens less those the cache
served, from each request's usage), the hit rate (cached over prompt tokens), the ideal hit rate
(from the token sequences alone: each request against everything computed before it was sent, as
if the cache were unbounded and on one worker), High's P50/P99 time to first token, output
tokens per second, and every text compared between the two sides. What the comparison may ask
depends on the workers' dtype (--dtype, default the host's; the JSON's `dtype`): in fp32 the
texts must be equal, since a prefix read from cached blocks holds the same numbers as one
recomputed; in bf16 they are not the same numbers (cached blocks were computed in other chunks
and batches), so a near-tie may flip a token and the texts may differ; there every stream on
both sides must instead continue exactly (bench/continuation.py: each token the greedy choice
after the ones before it), and the differing texts are counted, not a target.

    python bench/prefix_cache.py [--json PATH] [--plot PNG] [--model default --users 6 ...]

JSON: prefill_tokens_off, prefill_tokens_on, hit_rate, ideal_hit_rate, high_ttft_p50_ms_off/_on,
high_ttft_p99_ms_off/_on, tok_s_off/_on, texts_checked, texts_mismatched, continuations_broken
for the chat workload, the same keys with an _api suffix for the api workload, dtype, and
per-request series for the plot. Targets (chat): prompt tokens computed >= 3x fewer, High P50
TTFT >= 2x lower, hit rate >= 90% of the ideal; no mismatched text (fp32) or no broken
continuation (any dtype).
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.continuation import GreedyChecker  # noqa: E402
from bench.harness import PRIORITIES, machine, make_parser, model_or_bench, progress, quantile, write_json  # noqa: E402
from bench.qos_workloads import text_of_tokens  # noqa: E402
from services.common.config import ClusterConfig, PoolConfig, RouterConfig, SchedulerConfig, WorkerConfig  # noqa: E402
from services.common.proto.qos.v1 import router_pb2  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402
from services.tools.client import RouterClient, sampling_params  # noqa: E402

BLOCK = 16


@dataclass(slots=True)
class Sent:
    key: tuple                 # (user, turn) or (call,): the same request on both sides
    priority: str
    prompt: str
    sent_at: float = 0.0       # seconds since the side began
    ttft_ms: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    tenant: str = ""           # x-tenant (--tenants): the cache is scoped per tenant by default


def cluster_config(model: str, caching: bool, dtype: str | None) -> ClusterConfig:
    pool = PoolConfig(name="cpu", device="cpu", primary=True,
                      scheduler=SchedulerConfig(port=0, prefix_caching=caching, max_step_tokens=256),
                      workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=192, dtype=dtype) for _ in range(2)])
    return ClusterConfig(model=model, router=RouterConfig(port=0, http_port=-1), pools=[pool])


async def ask(client: RouterClient, sent: Sent, answer_tokens: int, start: float) -> None:
    request = router_pb2.GenerateRequest(prompt=sent.prompt, sampling=sampling_params(
        max_tokens=answer_tokens, temperature=0.0, ignore_eos=True))
    sent.sent_at = time.monotonic() - start
    began = time.perf_counter()
    async for chunk in client.stream(request, priority=sent.priority, tenant=sent.tenant or None):
        if chunk.token_ids and sent.ttft_ms != sent.ttft_ms:
            sent.ttft_ms = (time.perf_counter() - began) * 1000
        sent.output_ids.extend(chunk.token_ids)
        sent.text += chunk.text
        if chunk.usage.prompt_tokens:
            sent.prompt_tokens, sent.cached_tokens = chunk.usage.prompt_tokens, chunk.usage.cached_tokens


async def chat(client: RouterClient, plan: list[list[str]], system: str, args, bar) -> list[Sent]:
    """Each user's turns in order, each after the answer to the one before."""
    start, done = time.monotonic(), []

    async def user(index: int, messages: list[str]) -> None:
        await asyncio.sleep(index * args.stagger)
        conversation = system
        for turn, message in enumerate(messages):
            sent = Sent((index, turn), PRIORITIES[index % 3], f"{conversation}\nUser: {message}\nAssistant:",
                        tenant=f"tenant-{index % args.tenants}")
            await ask(client, sent, args.answer, start)
            done.append(sent)
            bar.update()
            conversation = sent.prompt + sent.text
            await asyncio.sleep(args.think)

    await asyncio.gather(*(user(i, messages) for i, messages in enumerate(plan)))
    return done


async def api(client: RouterClient, calls: list[tuple[float, str]], args, bar) -> list[Sent]:
    start, done, tasks = time.monotonic(), [], []

    async def one(sent: Sent) -> None:
        await ask(client, sent, args.api_answer, start)
        done.append(sent)
        bar.update()

    for i, (at, prompt) in enumerate(calls):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        tasks.append(asyncio.create_task(one(Sent((i,), PRIORITIES[i % 3], prompt, tenant=f"tenant-{i % args.tenants}"))))
    await asyncio.gather(*tasks)
    return done


def ideal_hit_rate(sent: list[Sent], tokenizer: TextTokenizer) -> float:
    """Cached over prompt tokens if every request found all full blocks it shares with what was
    computed before it was sent (prompt and output, but the last output token), within the blocks
    before its last prompt token: an unbounded cache on one worker."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    order = sorted(sent, key=lambda s: s.sent_at)
    ids = {id(s): tokenizer.encode(s.prompt) for s in order}
    pending = [(s.sent_at, ids[id(s)] + s.output_ids[:-1]) for s in order]
    for s in order:
        # What requests sent before this one computed: the whole of an earlier turn of a
        # conversation was computed before the next was sent; calls that overlap are counted as
        # if their shared blocks were there already (an upper bound, as "ideal" should be).
        while pending and pending[0][0] < s.sent_at:
            tokens = pending.pop(0)[1]
            seen.update(tuple(tokens[:(i + 1) * BLOCK]) for i in range(len(tokens) // BLOCK))
        prompt = ids[id(s)]
        usable, n = (len(prompt) - 1) // BLOCK, 0
        while n < usable and tuple(prompt[:(n + 1) * BLOCK]) in seen:
            n += 1
        hits += n * BLOCK
        total += len(prompt)
    return hits / total if total else float("nan")


def summary(sent: list[Sent], seconds: float) -> dict:
    high = [s.ttft_ms for s in sent if s.priority == "high"]
    prompt = sum(s.prompt_tokens for s in sent)
    cached = sum(s.cached_tokens for s in sent)
    return {"prefill_tokens": prompt - cached, "prompt_tokens": prompt, "hit_rate": cached / prompt if prompt else 0.0,
            "high_ttft_p50_ms": quantile(high, 0.5), "high_ttft_p99_ms": quantile(high, 0.99),
            "tok_s": sum(len(s.output_ids) for s in sent) / seconds, "requests": len(sent)}


def run_side(model: str, caching: bool, dtype: str | None, workload) -> tuple[list[Sent], float, str]:
    """The side's requests, its seconds, and the dtype its workers ran."""
    with LocalCluster(cluster_config(model, caching, dtype), quiet=True) as cluster:
        async def go():
            async with RouterClient(cluster.router_address) as client:
                began = time.monotonic()
                done = await workload(client)
                ran = {m.dtype for m in (await cluster.pool_stats()).members}
                return done, time.monotonic() - began, ran.pop()
        return asyncio.run(go())


def compare(name: str, off: list[Sent], on: list[Sent], seconds_off: float, seconds_on: float,
            tokenizer: TextTokenizer, suffix: str, checker: GreedyChecker) -> dict:
    a, b = summary(off, seconds_off), summary(on, seconds_on)
    texts_off = {s.key: s.text for s in off}
    mismatched = [s.key for s in on if texts_off.get(s.key) != s.text]
    broken = [s.key for s in off + on if checker.broken_at(tokenizer.encode(s.prompt), s.output_ids) is not None]
    ideal = ideal_hit_rate(on, tokenizer)
    out = {f"prefill_tokens_off{suffix}": a["prefill_tokens"], f"prefill_tokens_on{suffix}": b["prefill_tokens"],
           f"hit_rate{suffix}": b["hit_rate"], f"ideal_hit_rate{suffix}": ideal,
           f"high_ttft_p50_ms_off{suffix}": a["high_ttft_p50_ms"], f"high_ttft_p50_ms_on{suffix}": b["high_ttft_p50_ms"],
           f"high_ttft_p99_ms_off{suffix}": a["high_ttft_p99_ms"], f"high_ttft_p99_ms_on{suffix}": b["high_ttft_p99_ms"],
           f"tok_s_off{suffix}": a["tok_s"], f"tok_s_on{suffix}": b["tok_s"],
           f"requests{suffix}": b["requests"], f"prompt_tokens{suffix}": b["prompt_tokens"],
           f"texts_checked{suffix}": len(on), f"texts_mismatched{suffix}": len(mismatched),
           f"continuations_checked{suffix}": len(off + on), f"continuations_broken{suffix}": len(broken),
           f"series{suffix}": {side: [[s.sent_at, s.priority, s.ttft_ms, s.prompt_tokens, s.cached_tokens]
                                      for s in sorted(run, key=lambda s: s.sent_at)]
                               for side, run in (("off", off), ("on", on))}}
    print(f"\n{name}: {b['requests']} requests, {b['prompt_tokens']:,} prompt tokens")
    print(f"  {'':<28}{'cache off':>12}{'cache on':>12}{'off / on':>10}")
    for label, key, fmt in [("prompt tokens computed", "prefill_tokens", "{:,.0f}"),
                            ("High TTFT P50 (ms)", "high_ttft_p50_ms", "{:.0f}"),
                            ("High TTFT P99 (ms)", "high_ttft_p99_ms", "{:.0f}"), ("output tok/s", "tok_s", "{:.1f}")]:
        ratio = a[key] / b[key] if b[key] else float("inf")
        print(f"  {label:<28}{fmt.format(a[key]):>12}{fmt.format(b[key]):>12}{ratio:>9.2f}x")
    print(f"  hit rate {b['hit_rate']:.1%} (ideal {ideal:.1%}, {b['hit_rate'] / ideal:.0%} of it); "
          f"texts mismatched {len(mismatched)} of {len(on)} ({checker.dtype}); "
          f"continuations broken {len(broken)} of {len(off + on)}")
    return out


def plot(path: Path, result: dict, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex="col")
    for column, (suffix, name) in enumerate((("", "multi-turn chat"), ("_api", "API calls, shared system prompts"))):
        series = result[f"series{suffix}"]
        for side, color in (("off", "#888888"), ("on", "#1f618d")):
            rows = series[side]
            high = [(t, ttft) for t, p, ttft, _, _ in rows if p == "high"]
            axes[0][column].plot([t for t, _ in high], [v for _, v in high], "o", ms=3, color=color,
                                 label=f"cache {side}")
            cum_prompt = cum_cached = 0
            xs, ys = [], []
            for t, _, _, prompt, cached in rows:
                cum_prompt, cum_cached = cum_prompt + prompt, cum_cached + cached
                xs.append(t)
                ys.append(100 * cum_cached / cum_prompt if cum_prompt else 0)
            axes[1][column].plot(xs, ys, color=color, label=f"cache {side}")
        axes[1][column].axhline(100 * result[f"ideal_hit_rate{suffix}"], color="#c0392b", ls="--", lw=1,
                                label="ideal (unbounded, one worker)")
        axes[0][column].set_title(name)
        axes[0][column].set_ylabel("High TTFT (ms)")
        axes[0][column].set_yscale("log")
        axes[1][column].set_ylabel("hit rate so far (% of prompt tokens)")
        axes[1][column].set_xlabel("seconds since the side began")
        for ax in (axes[0][column], axes[1][column]):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--model", help="model folder (default: the random-weight bench model; 'default': SmolLM2)")
    parser.add_argument("--users", type=int, default=18)
    parser.add_argument("--system-tokens", type=int, default=200, help="the chat's shared system prompt")
    parser.add_argument("--answer", type=int, default=24, help="tokens per chat answer")
    parser.add_argument("--think", type=float, default=0.5)
    parser.add_argument("--stagger", type=float, default=1.0)
    parser.add_argument("--api-requests", type=int, default=120)
    parser.add_argument("--api-rate", type=float, default=3.0)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--api-system-tokens", type=int, default=600)
    parser.add_argument("--api-answer", type=int, default=16)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="the workers' dtype (default: the host's)")
    parser.add_argument("--tenants", type=int, default=1,
                        help="spread users and calls over this many tenants (x-tenant, in turn): the cache "
                             "is scoped per tenant, so what they share across tenants is computed again")
    args = parser.parse_args()
    model = model_or_bench(args.model)
    tokenizer = TextTokenizer.from_model_dir(model)
    rng = random.Random(args.seed)
    system = "System: " + text_of_tokens(tokenizer, rng, args.system_tokens)[0]
    plan = [[text_of_tokens(tokenizer, rng, rng.randint(16, 48))[0] for _ in range(rng.randint(3, 8))]
            for _ in range(args.users)]
    prompts = ["System: " + text_of_tokens(tokenizer, rng, args.api_system_tokens)[0]
               for _ in range(args.system_prompts)]
    at, calls = 0.0, []
    for _ in range(args.api_requests):
        at += rng.expovariate(args.api_rate)
        calls.append((at, f"{rng.choice(prompts)}\nQuestion: {text_of_tokens(tokenizer, rng, rng.randint(16, 32))[0]}\n"
                          "Answer:"))
    result = {"machine": machine(), "model": Path(model).name, "workers": 2, "args": {
        k: v for k, v in vars(args).items() if k not in ("json", "plot")}}
    turns = sum(len(p) for p in plan)
    runs = {}
    for workload, count, make in (("chat", turns, lambda c, bar: chat(c, plan, system, args, bar)),
                                  ("api", len(calls), lambda c, bar: api(c, calls, args, bar))):
        for caching in (False, True):
            with progress(count, f"{workload}, cache {'on' if caching else 'off'}") as bar:
                runs[(workload, caching)] = run_side(model, caching, args.dtype, lambda c: make(c, bar))
    result["dtype"] = runs[("chat", True)][2]
    checker = GreedyChecker(model, result["dtype"])
    result.update(compare("multi-turn chat", *runs[("chat", False)][:1], *runs[("chat", True)][:1],
                          runs[("chat", False)][1], runs[("chat", True)][1], tokenizer, "", checker))
    result.update(compare("API calls sharing system prompts", *runs[("api", False)][:1], *runs[("api", True)][:1],
                          runs[("api", False)][1], runs[("api", True)][1], tokenizer, "_api", checker))
    checks = {"prefill 3x fewer": result["prefill_tokens_off"] >= 3 * result["prefill_tokens_on"],
              "High P50 TTFT 2x lower": result["high_ttft_p50_ms_off"] >= 2 * result["high_ttft_p50_ms_on"],
              "hit rate >= 90% of ideal": result["hit_rate"] >= 0.9 * result["ideal_hit_rate"],
              "no broken continuation": result["continuations_broken"] == 0 and result["continuations_broken_api"] == 0}
    if result["dtype"] == "float32":
        checks["no mismatched text (fp32)"] = result["texts_mismatched"] == 0 and result["texts_mismatched_api"] == 0
    print("targets (chat): " + ", ".join(f"{k} {'met' if ok else 'NOT met'}" for k, ok in checks.items()))
    write_json(args.json, result)
    if args.plot:
        plot(args.plot, result, f"prefix caching off vs on: {Path(model).name}, one pool of two CPU workers; {machine()}")
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
