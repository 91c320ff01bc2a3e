#!/usr/bin/env python
"""Noisy neighbour: inside one priority class, does one tenant's flood hurt another tenant?

Tenant A floods --a-requests (200) Low requests; tenant B sends --b-requests (20) Low requests at
the same time (both spread over the first --spread seconds, 1). Same requests twice: the
scheduler with tenant fairness off (one FIFO per class, arrival order) and on (tenants of a class
share its tokens by weight: services/scheduler/tenant_queue.py). Each tenant is its own client
process (bench/loadgen.py); the tenant rides in x-tenant (auth off). Bench model, one CPU worker.

    python bench/tenant_fairness.py [--json PATH] [--a-requests 200] [--b-requests 20]

Writes b_p99_ttft_ms_off, b_p99_ttft_ms_on, a_tok_s_off, a_tok_s_on (and P50s, B's throughput).
Targets: B's P99 TTFT at least 5x lower with fairness on; A keeps >= 0.8x of its throughput.
"""
from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import machine, make_parser, model_or_bench, progress, quantile, write_json  # noqa: E402
from bench.loadgen import Front, Job, run_clients  # noqa: E402
from bench.qos_workloads import text_of_tokens  # noqa: E402
from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402

PROMPT_TOKENS, OUTPUT_TOKENS = 256, 64


def workload(tokenizer: TextTokenizer, a: int, b: int, spread: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for tenant, count in (("A", a), ("B", b)):
        for _ in range(count):
            text, n = text_of_tokens(tokenizer, rng, PROMPT_TOKENS)
            jobs.append(Job("low", text, n, OUTPUT_TOKENS, rng.uniform(0.0, spread), tenant))
    return jobs


def run_once(model: str, jobs: list[Job], fair: bool, args) -> dict:
    config = single_pool(model=model, router=RouterConfig(port=0, http_port=-1),
                         scheduler=SchedulerConfig(port=0, max_step_tokens=128, max_running=16,
                                                   tenant_fairness=fair),
                         workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=512)])
    label = f"fairness {'on' if fair else 'off'}"
    with LocalCluster(config, quiet=True) as cluster, progress(len(jobs), label) as bar:
        outcomes, _ = asyncio.run(run_clients(Front.of("grpc", cluster), jobs, on_progress=bar.update))
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise SystemExit(f"{label}: {len(failed)} failed, e.g. {failed[0].code}: {failed[0].detail}")
    figures = {}
    for tenant in ("A", "B"):
        mine = [o for o in outcomes if o.tenant == tenant]
        ttft = [o.ttft_ms for o in mine]
        figures[tenant] = {"p99": quantile(ttft, 0.99), "p50": quantile(ttft, 0.5),
                           "tok_s": sum(o.tokens for o in mine) / max(o.done_at for o in mine)}
    return figures


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--a-requests", type=int, default=200)
    parser.add_argument("--b-requests", type=int, default=20)
    parser.add_argument("--spread", type=float, default=1.0, help="arrivals over this many seconds")
    parser.add_argument("--model", help="model folder (default: the random-weight bench model)")
    args = parser.parse_args()
    model = model_or_bench(args.model)
    jobs = workload(TextTokenizer.from_model_dir(model), args.a_requests, args.b_requests, args.spread, args.seed)
    off, on = run_once(model, jobs, False, args), run_once(model, jobs, True, args)
    ratio_b = off["B"]["p99"] / on["B"]["p99"]
    ratio_a = on["A"]["tok_s"] / off["A"]["tok_s"]
    print(f"\nLow class: A {args.a_requests} requests, B {args.b_requests}, {PROMPT_TOKENS} prompt + "
          f"{OUTPUT_TOKENS} output tokens, over {args.spread:g} s; {Path(model).name}; {machine()}\n")
    print(f"{'':<22}{'fairness off':>14}{'fairness on':>13}{'change':>14}")
    print(f"{'B P99 TTFT (ms)':<22}{off['B']['p99']:>14.0f}{on['B']['p99']:>13.0f}{ratio_b:>11.1f}x lower")
    print(f"{'B P50 TTFT (ms)':<22}{off['B']['p50']:>14.0f}{on['B']['p50']:>13.0f}")
    print(f"{'A P99 TTFT (ms)':<22}{off['A']['p99']:>14.0f}{on['A']['p99']:>13.0f}")
    print(f"{'A throughput (tok/s)':<22}{off['A']['tok_s']:>14.1f}{on['A']['tok_s']:>13.1f}{ratio_a:>13.2f}x")
    print(f"targets: B P99 >= 5x lower: {'met' if ratio_b >= 5 else 'NOT met'}; "
          f"A keeps >= 0.8x: {'met' if ratio_a >= 0.8 else 'NOT met'}")
    write_json(args.json, {
        "b_p99_ttft_ms_off": off["B"]["p99"], "b_p99_ttft_ms_on": on["B"]["p99"],
        "b_p50_ttft_ms_off": off["B"]["p50"], "b_p50_ttft_ms_on": on["B"]["p50"],
        "a_tok_s_off": off["A"]["tok_s"], "a_tok_s_on": on["A"]["tok_s"],
        "b_tok_s_off": off["B"]["tok_s"], "b_tok_s_on": on["B"]["tok_s"],
        "a_requests": args.a_requests, "b_requests": args.b_requests, "machine": machine()})


if __name__ == "__main__":
    main()
