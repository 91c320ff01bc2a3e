"""The cache tiers table in docs/performance.md (bench/cache_tiers.py, one JSON per workload).
Registered by bench/perf_doc.py, which renders and checks every table."""
from __future__ import annotations

from bench.perf_doc_format import RESULTS, num, pct

WORKLOADS = ("synthetic", "synthetic_middle300", "synthetic_last300", "conversation", "chat", "api")
SOURCES = tuple(f"cache_tiers_{name}.json" for name in WORKLOADS)


def ratio(value: float) -> str:
    return f"{value:.0%}" if value == value else "- (nothing to serve)"      # NaN: an ideal of 0


def cache_tiers(*results: dict) -> list[list[str]]:
    rows = [["workload", "requests; pool", "ideal: bounded (LRU) / optimum / unbounded",
             "served: pool / pool + tier", "pool of bounded", "tier of unbounded",
             "prefill tokens: off / pool / tier", "High TTFT P50: off / pool / tier", "texts mismatched"]]
    for name, r in zip(WORKLOADS, results):
        high = [r[side]["classes"]["high"]["ttft_p50_ms"] for side in ("off", "pool", "tier")]
        ratios = r["ratios"]
        trace = r["trace"]
        window = f"{num(trace['requests'])} from row {num(trace.get('skip', 0))}"
        if trace["speed"] != 1:
            window += f", speed {trace['speed']:g}"
        rows.append([
            f"{r['workload']} ([json](../{RESULTS}/cache_tiers_{name}.json))",
            f"{window}; {num(r['server']['capacity_blocks'])} blocks",
            f"{pct(r['bounded_ideal_share'])} / {pct(r['bounded_optimal_share'])} / {pct(r['unbounded_ideal_share'])}",
            f"{pct(r['pool']['served_cached_share'])} / {pct(r['tier']['served_cached_share'])}",
            ratio(ratios["pool_of_bounded_ideal"]), ratio(ratios["tier_of_unbounded_ideal"]),
            " / ".join(num(r[side]["prefill_tokens"]) for side in ("off", "pool", "tier")),
            " / ".join(f"{num(ms)} ms" for ms in high) + f" ({high[0] / high[2]:.2f}x)",
            f"{r['pool_vs_off']['texts_mismatched'] + r['tier_vs_off']['texts_mismatched']} of "
            f"{num(r['pool_vs_off']['texts_checked'] + r['tier_vs_off']['texts_checked'])}"])
    return rows
