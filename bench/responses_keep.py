#!/usr/bin/env python
"""What keeping a Responses API answer costs (store: true, OpenAI's default): the same one-token
request, kept and not kept, in alternating pairs (which goes first alternates too), on one cluster
in one run; the figure is the median of the paired differences with a bootstrap 95% interval.
Beside it, the store's write alone (ResponseStore.add of a row like those, timed directly).

The answer is kept before it goes out (so the next turn can name it at once): its write is on the
request's path, and this is what that costs. SmolLM2-135M on one CPU worker; the store is the
cluster's (SQLite by default; --store-url for PostgreSQL).

    python bench/responses_keep.py [--json PATH] [--pairs N] [--store-url URL]
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import machine, make_parser, median_ci, progress, write_json  # noqa: E402
from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402
from services.store.response_store import ResponseStore  # noqa: E402
from services.store.store import Store  # noqa: E402

PROMPT = "Write one sentence about the sea."


def ask(url: str, model: str, store: bool) -> tuple[float, dict]:
    body = json.dumps({"model": model, "input": PROMPT, "max_output_tokens": 1, "temperature": 0,
                       "store": store}).encode()
    request = urllib.request.Request(url, body, {"content-type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as answer:
        data = json.loads(answer.read())
    return (time.perf_counter() - start) * 1e3, data


def store_write_ms(url: str | None, row: dict, count: int = 200) -> list[float]:
    store = Store(url)
    kept, times = ResponseStore(store), []
    try:
        for k in range(count):
            now = time.time()
            start = time.perf_counter()
            kept.add("bench", {**row, "id": f"resp_bench_{now}_{k}"}, [], now, now + 60)
            times.append((time.perf_counter() - start) * 1e3)
        kept.purge(time.time() + 120)
    finally:
        store.close()
    return times


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--store-url", default=None, help="the cluster's store (default: SQLite)")
    args = parser.parse_args()
    config = single_pool(router=RouterConfig(port=0, http_port=0), scheduler=SchedulerConfig(port=0),
                         workers=[WorkerConfig(port=0, threads=1, dtype="fp32")])
    config.store.url = args.store_url
    kept_ms, unkept_ms, diffs = [], [], []
    with LocalCluster(config, quiet=True) as cluster:
        router = cluster.config.router
        url = f"http://{router.host}:{router.http_port}/v1/responses"
        model = Path(cluster.config.model).name
        for _ in range(10):                      # warm-up: both paths, the prefix cache filled
            ask(url, model, True), ask(url, model, False)
        with progress(args.pairs, "pairs", unit="pair") as bar:
            for k in range(args.pairs):
                order = (True, False) if k % 2 == 0 else (False, True)
                timed = {store: ask(url, model, store) for store in order}
                assert timed[True][1]["store"] is True and timed[False][1]["store"] is False
                kept_ms.append(timed[True][0])
                unkept_ms.append(timed[False][0])
                diffs.append(timed[True][0] - timed[False][0])
                bar.update()
        row = timed[True][1]
    writes = store_write_ms(args.store_url, row)
    median, low, high = median_ci(diffs)
    backend = "PostgreSQL" if args.store_url and args.store_url.startswith("postgresql") else "SQLite"
    print(f"\n{args.pairs} pairs of one-token Responses requests, kept and not, store {backend}; {machine()}\n")
    print(f"request, not kept   P50 {statistics.median(unkept_ms):7.2f} ms")
    print(f"request, kept       P50 {statistics.median(kept_ms):7.2f} ms")
    print(f"kept - not kept     median {median:+.2f} ms (95% CI {low:+.2f} .. {high:+.2f}) over {len(diffs)} pairs")
    print(f"store write alone   P50 {statistics.median(writes):7.2f} ms over {len(writes)} rows "
          f"of {len(json.dumps(row))} bytes")
    write_json(args.json, {
        "store": backend, "pairs": args.pairs, "unkept_p50_ms": statistics.median(unkept_ms),
        "kept_p50_ms": statistics.median(kept_ms), "kept_minus_unkept_median_ms": median,
        "kept_minus_unkept_ci95_ms": [low, high], "store_write_p50_ms": statistics.median(writes),
        "row_bytes": len(json.dumps(row)), "machine": machine()})


if __name__ == "__main__":
    main()
