"""The measured tables of docs/performance.md, docs/operations.md and README.md, rendered from the
JSON files under bench/results/ that hold their figures, so that a page and its measurements
cannot differ (tests/unit/test_perf_doc.py compares them). The prose around a table is written
by hand; the table sits between a marker that names it and its JSON, and a closing marker:

    <!-- table: engine-roofline (rendered from bench/results/engine_throughput.json by bench/perf_doc.py) -->

    | dtype | phase | tok/s | ...

    <!-- /table -->

    python -m bench.perf_doc --check     # exit 1 naming each table that differs from its JSON
    python -m bench.perf_doc --write     # rewrite every table in place
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from bench.perf_doc_cache import SOURCES as CACHE_TIER_SOURCES, cache_tiers
from bench.perf_doc_engine import PAIRED_SOURCES, engine_paired, engine_per_core, engine_roofline, engine_vs_llamacpp
from bench.perf_doc_faults import fault_sim
from bench.perf_doc_format import RESULTS, num, pct

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/performance.md", "docs/operations.md")
BLOCK = re.compile(r"<!-- table: (?P<name>[\w-]+) .*?-->\n.*?<!-- /table -->", re.DOTALL)
DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
ENGINE_CACHE_CAPACITY = 128     # services/engine/linear.py's CACHE_CAPACITY (the test checks it)


@dataclass(frozen=True)
class Table:
    name: str
    sources: tuple[str, ...]                # file names under bench/results/
    render: Callable[..., list[list[str]]]  # the loaded sources -> rows, the header first

    def marker(self) -> str:
        files = " and ".join(f"{RESULTS}/{source}" for source in self.sources)
        return f"<!-- table: {self.name} (rendered from {files} by bench/perf_doc.py) -->"


TABLES: dict[str, Table] = {}


def table(name: str, *sources: str):
    def register(render):
        TABLES[name] = Table(name, sources, render)
        return render
    return register


def signed_pct(error: float) -> str:
    return f"{100 * error:+.0f}%"


def with_ci(ratio: float, low: float, high: float) -> str:
    return f"{ratio:.2f} [{low:.2f}, {high:.2f}]"


def each(values: list[str]) -> str:
    """Values of every run or pair, "7.7% each" when they all read the same."""
    return f"{values[0]} each" if len(set(values)) == 1 else ", ".join(values)


def markdown(rows: list[list[str]]) -> str:
    lines = ["|" + "|".join(f" {cell} " if cell else " " for cell in row) + "|" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


# README.md

@table("burst-summary", "qos_burst_bf16.json")
def burst_summary(run: dict) -> list[list[str]]:
    fcfs, qos = run["fcfs"], run["qos"]
    return [["", "FCFS", "QoS"],
            ["High P99 time to first token", f"{fcfs['high_p99_ttft_ms'] / 1000:.0f} s",
             f"{qos['high_p99_ttft_ms']:.0f} ms ({qos['high_p99_ttft_over_idle']:.1f}x its idle P50)"],
            ["Low throughput", f"{fcfs['low_tok_s']:.1f} tok/s", f"{qos['low_tok_s']:.1f} tok/s"],
            ["Low's peak share of KV blocks (QoS cap 30%)", "no cap", pct(qos["low_kv_peak_frac"])]]


# docs/performance.md

@table("qos-virtual", "qos_virtual.json")
def qos_virtual(result: dict) -> list[list[str]]:
    rows = [["profile", "High P99 TTFT, FCFS / QoS (virtual ms)", "High P99 steps waited, FCFS / QoS",
             "QoS without cut-ins", "Low tok/s QoS / FCFS", "Low KV peak, FCFS / QoS", "High success"]]
    for name, profile in result["profiles"].items():
        fcfs, qos, bare = profile["fcfs"], profile["qos"], profile["qos_no_cut_ins"]
        rows.append([name, f"{num(fcfs['high_p99_ttft_ms'])} / {num(qos['high_p99_ttft_ms'])}",
                     f"{num(fcfs['high_p99_steps_waited'])} / {num(qos['high_p99_steps_waited'])}",
                     f"{num(bare['high_p99_ttft_ms'])} ms, {num(bare['high_p99_steps_waited'])} steps",
                     f"{profile['low_tok_s_ratio']:.2f}", f"{pct(fcfs['low_kv_peak'])} / {pct(qos['low_kv_peak'])}",
                     pct(qos["high_success"], 0)])
    return rows


REAL_FIGURES = (("high_p99_ttft_ms (scheduler)", "High P99 TTFT at the scheduler"),
                ("high_p99_ttft_ms (client)", "High P99 TTFT at the client"),
                ("high_p50_ttft_ms", "High P50 TTFT"), ("low_tok_s", "Low tok/s"), ("low_kv_peak", "Low KV peak"))


def real_against_simulated(key: str, figure: dict) -> str:
    real, simulated = figure["real"], figure["simulated"]
    if key == "low_kv_peak":
        values = f"{pct(real)} / {pct(simulated)}"
    elif key == "low_tok_s":
        values = f"{real:.0f} / {simulated:.0f}"
    elif min(real, simulated) >= 10_000:
        values = f"{real / 1000:.1f} / {simulated / 1000:.1f} s"
    else:
        values = f"{real:.0f} / {simulated:.0f} ms"
    return f"{values} ({signed_pct(figure['difference'])})"


@table("qos-virtual-real", "qos_virtual.json")
def qos_virtual_real(result: dict) -> list[list[str]]:
    real = result["real_comparison"]
    rows = [["figure", "FCFS: real / simulated", "QoS: real / simulated"]]
    for key, label in REAL_FIGURES:
        rows.append([label] + [real_against_simulated(key, real[policy][key]) for policy in ("fcfs", "qos")])
    return rows


table("engine-roofline", "engine_throughput.json")(engine_roofline)
table("engine-vs-llamacpp", "engine_vs_llamacpp.json")(engine_vs_llamacpp)
table("engine-per-core", "engine_vs_llamacpp.json")(engine_per_core)
table("engine-paired", *PAIRED_SOURCES)(engine_paired)
table("fault-sim", "fault_sim.json")(fault_sim)
table("cache-tiers", *CACHE_TIER_SOURCES)(cache_tiers)

TENANT_SCENARIOS = {"2 backlogged": "2 tenants, backlogged", "8 backlogged": "8 tenants, backlogged",
                    "2 on/off": "2 tenants, one on/off", "8 on/off": "8 tenants, four on/off"}


@table("tenant-service", "tenant_service.json")
def tenant_service(result: dict) -> list[list[str]]:
    rows = [["scenario", "max service difference (tokens)", "VTC bound", "Jain's index",
             "one FIFO: difference, Jain"]]
    for name, scenario in result["scenarios"].items():
        fair, fifo = scenario["fair"], scenario["fifo"]
        rows.append([TENANT_SCENARIOS.get(name, name), num(fair["max_service_diff"]), num(scenario["vtc_bound"]),
                     f"{fair['jain_index']:.3f}", f"{num(fifo['max_service_diff'])}, {fifo['jain_index']:.3f}"])
    return rows


@table("simulator-validation", "simulator_validation.json")
def simulator_validation(runs: list[dict]) -> list[list[str]]:
    rows = [["run", "cost", "High P99", "Medium P99", "High P99 real / simulated (ms)", "Medium P99, real routes"]]
    for run in runs:
        rows.append([f"{run['mode']}, {run['rate']:g}/s", signed_pct(run["cost_err"]), signed_pct(run["high_p99_err"]),
                     signed_pct(run["medium_p99_err"]),
                     f"{run['high_p99_real_ms']:.0f} / {run['high_p99_simulated_ms']:.0f}",
                     signed_pct(run["medium_p99_err_real_routes"])])
    return rows


ABLATION_LABELS = {
    "first_token_alone": "High's first-token work alone in its step (`alone`) vs the fair order (`wfq`)",
    "first_token_ahead": "High's first-token work ahead of the fair order (`ahead`) vs `wfq`",
    "first_token_alone_vs_ahead": "`alone` vs `ahead`",
    "cut_in": "High cut-ins into the step in flight",
    "router_intake": "the router's priority intake vs arrival order",
    "stream_intervals": "Medium and Low stream 4 and 16 tokens a chunk vs 1",
    "cut_in_slots": "cut-ins may take slots beyond `max_running` (a quarter)",
    "first_token_hold": "Medium and Low admissions held while High waits for a first token (50 ms)",
    "high_lane": "a router port of its own for High",
    "tokenizer_nice": "Medium's and Low's tokenizer threads at nice +15 / +19",
    "tokenize_inline": "short prompts tokenized on the event loop, not a thread",
    "router_nice": "the router at nice +2",
    "short_steps": "steps kept to 30 ms while High is in the pool",
    "forward_window": "the router forwards at most 8 Medium / Low requests per class and pool at once",
    "cpu_binding": "the worker on a core of its own, the rest on the other",
}
# The measured run's rows in the order the page discusses them (the JSON's is the order they ran).
ABLATION_ORDER = list(ABLATION_LABELS)


def in_page_order(mechanisms: list[dict]) -> list[dict]:
    order = {name: i for i, name in enumerate(ABLATION_ORDER)}
    return sorted(mechanisms, key=lambda m: order.get(m["name"], len(order)))


def ablation_rows(mechanisms: list[dict], first: str) -> list[list[str]]:
    rows = [[first, "High P50", "High P90 [95% CI]", "High P99", "Low tok/s [95% CI]", "verdict"]]
    for m in mechanisms:
        rows.append([ABLATION_LABELS.get(m["name"], m["what"]), f"{m['p50_ratio']:.2f}",
                     with_ci(m["p90_ratio"], m["p90_ci_low"], m["p90_ci_high"]), f"{m['p99_ratio']:.2f}",
                     with_ci(m["low_tok_s_ratio"], m["low_tok_s_ci_low"], m["low_tok_s_ci_high"]), m["verdict"]])
    return rows


@table("ablation", "ablation_measured.json")
def ablation(result: dict) -> list[list[str]]:
    return ablation_rows(in_page_order(result["mechanisms"]), "mechanism")


@table("ablation-reruns", "ablation_measured.json")
def ablation_reruns(result: dict) -> list[list[str]]:
    return ablation_rows(result["reruns"]["mechanisms"], "re-run (nothing else running)")


PAIRED_FIGURES = (("qos_high_p99_ttft_ms", "QoS: High P99 TTFT (ms)", lambda v: f"{v:.0f}"),
                  ("qos_high_p99_over_idle", "QoS: High P99 TTFT / idle P50", lambda v: f"{v:.2f}"),
                  ("qos_low_tok_s", "QoS: Low tok/s", lambda v: f"{v:.1f}"),
                  ("qos_low_kv_peak_frac", "QoS: Low KV peak (share of blocks)", pct),
                  ("fcfs_high_p99_ttft_ms", "FCFS: High P99 TTFT (s)", lambda v: f"{v / 1000:.1f}"),
                  ("fcfs_low_tok_s", "FCFS: Low tok/s", lambda v: f"{v:.1f}"))


@table("paired-burst", "paired_burst.json")
def paired_burst(paired: dict) -> list[list[str]]:
    rows = [["figure", "old (each pair)", "new (each pair)", "new / old [95% CI]"]]
    for key, label, fmt in PAIRED_FIGURES:
        figure = paired["figures"][key]
        rows.append([label, each([fmt(v) for v in figure["old"]]), each([fmt(v) for v in figure["new"]]),
                     with_ci(figure["ratio"], figure["ci_low"], figure["ci_high"])])
    return rows


table("paired-burst-prompt-kernel", "paired_burst_prompt_kernel.json")(paired_burst)


@table("prefix-cache", "prefix_cache.json", "prefix_cache_bf16.json", "prefix_cache_smollm2.json")
def prefix_cache(*results: dict) -> list[list[str]]:
    rows = [["workload, model, dtype", "prompt tokens computed, off / on", "hit rate (ideal)",
             "High TTFT P50, off / on", "High TTFT P99, off / on", "texts differing, off / on",
             "continuations broken"]]
    for result in results:
        model = "SmolLM2" if result["model"].startswith("SmolLM2") else "bench model"
        # Runs recorded before the JSON named its dtype ran fp32: the CPU engine had no other then.
        dtype = DTYPE_LABELS[result.get("dtype", "float32")]
        for suffix, workload in (("", "chat"), ("_api", "API")):
            def get(key):
                return result[key + suffix]
            off, on = get("prefill_tokens_off"), get("prefill_tokens_on")
            p50_off, p50_on = get("high_ttft_p50_ms_off"), get("high_ttft_p50_ms_on")
            broken = f"{get('continuations_broken')} of {get('continuations_checked')}" \
                if "continuations_checked" + suffix in result else "not checked (texts compared)"
            rows.append([f"{workload}, {model}, {dtype}", f"{num(off)} / {num(on)} ({off / on:.1f}x fewer)",
                         f"{pct(get('hit_rate'))} ({pct(get('ideal_hit_rate'))})",
                         f"{num(p50_off)} / {num(p50_on)} ms ({p50_off / p50_on:.1f}x)",
                         f"{num(get('high_ttft_p99_ms_off'))} / {num(get('high_ttft_p99_ms_on'))} ms",
                         f"{get('texts_mismatched')} of {get('texts_checked')}", broken])
    return rows


@table("prefix-cache-isolation", "prefix_cache_bf16.json", "prefix_cache_tenants.json")
def prefix_cache_isolation(one: dict, many: dict) -> list[list[str]]:
    tenants = many["args"]["tenants"]
    rows = [["workload", "prompt tokens computed, 1 tenant / " + f"{tenants} tenants",
             f"hit rate, 1 tenant / {tenants} tenants (ideal, shared)", "High TTFT P50, 1 / " + f"{tenants} tenants"]]
    for suffix, workload in (("", "chat: each conversation inside one tenant"),
                             ("_api", "API: system prompts shared across tenants")):
        def both(key):
            return one[key + suffix], many[key + suffix]
        (a, b), (ha, hb), (ta, tb) = both("prefill_tokens_on"), both("hit_rate"), both("high_ttft_p50_ms_on")
        rows.append([workload, f"{num(a)} / {num(b)} ({b / a:.2f}x)",
                     f"{pct(ha)} / {pct(hb)} ({pct(one['ideal_hit_rate' + suffix])})", f"{num(ta)} / {num(tb)} ms"])
    return rows


@table("long-context-burst", "long_context.json")
def long_context_burst(result: dict) -> list[list[str]]:
    return [["", "measured"],
            ["Low documents completed (dense mode refuses them: past the context)",
             f"{result['low_completed']} of {result['low_submitted']}"],
            [f"Low's peak KV blocks (cap {pct(result['low_kv_cap'], 0)})",
             f"{num(result['low_kv_peak_blocks'])} of {num(result['kv_blocks_total'])}, "
             f"{pct(result['low_kv_peak'])} of the pool"],
            ["High TTFT during the burst: P50, P99",
             f"{num(result['high_p50_ttft_ms'])} ms, {num(result['high_p99_ttft_ms'])} ms"],
            ["High's idle TTFT (P50, the same chats one at a time before the burst)",
             f"{num(result['high_idle_p50_ms'])} ms: P99 under the burst is {result['high_p99_over_idle']:.2f}x it"],
            ["Medium, High completed", f"{result['medium_completed']} of {result['medium_submitted']}, "
                                       f"{result['high_completed']} of {result['high_submitted']}"]]


@table("long-context-throughput", "long_context.json")
def long_context_throughput(result: dict) -> list[list[str]]:
    dense = dict(map(tuple, result["tok_s_by_length_dense"]))
    lengths = [tokens for tokens, _ in result["tok_s_by_length"]]
    return [["document (tokens)"] + [num(tokens) for tokens in lengths],
            ["streaming mode"] + [num(rate) for _, rate in result["tok_s_by_length"]],
            ["dense"] + [num(dense[tokens]) if tokens in dense else "" for tokens in lengths]]


@table("stream-perplexity", "stream_perplexity.json")
def stream_perplexity(result: dict) -> list[list[str]]:
    context, shift, tokens = result["context"], result["curves"]["dense_shifted_start"], result["tokens"]
    window = num(result["window_tokens"])

    def row(label: str, dense: float, sinks: float, window_only: float) -> list[str]:
        return [label, f"{dense:.2f}", f"{sinks:.2f} ({100 * (sinks / dense - 1):+.1f}%)",
                f"{window_only:.2f} ({window_only / dense:.2f}x)"]
    return [["positions", "dense", f"{result['sink_tokens']} sinks + window {window}", f"window {window}, no sinks"],
            row(f"0-{num(context - 1)} (within the context)", result["ppl_dense_within_context"],
                result["ppl_sinks_within_context"], result["ppl_window_only_within_context"]),
            row(f"{num(context)}-{num(shift + context - 1)} (past it; dense run again from position {num(shift)})",
                result["ppl_dense_past_context"], result["ppl_sinks_past_context"],
                result["ppl_window_only_past_context"]),
            [f"0-{num(tokens - 1)} (all)", "cannot: past the context", f"{result['ppl_sinks_all_tokens']:.2f}",
             f"{result['ppl_window_only_all_tokens']:.2f}"]]


@table("onednn-cache", "onednn_cache.json")
def onednn_cache(result: dict) -> list[list[str]]:
    baseline = result["baseline_capacity"]
    rows = [["capacity", f"wall time vs {num(baseline)} (median, 95% CI)",
             "resident memory growth over the run (median)"]]
    notes = {baseline: " (oneDNN's default)", ENGINE_CACHE_CAPACITY: " (the engine's)"}
    for capacity, runs in sorted(result["capacities"].items(), key=lambda item: -int(item[0])):
        capacity = int(capacity)
        low, high = runs["time_ratio_ci95"]
        time = (f"{runs['time_ratio_median']:.3f}" if capacity == baseline else
                f"{runs['time_ratio_median']:.3f} ({low:.3f}-{high:.3f})")
        rows.append([num(capacity) + notes.get(capacity, ""), time, f"+{median(runs['rss_growth_mb']):.0f} MB"])
    return rows


# docs/operations.md

FAULTS = (("worker_kills", "worker kills"), ("scheduler_kills", "scheduler kills"), ("router_kills", "router kills"),
          ("hangs", "hangs"), ("losses", "loss"), ("partitions", "partitions"), ("delays", "delays"))


@table("chaos", "chaos.json", "chaos_bf16.json", "chaos_soak.json")
def chaos(*runs: dict) -> list[list[str]]:
    rows = [["run", "dtype, model", "faults", "submitted", "completed", "failed", "lost",
             "cut by a router kill (retried)", "continuations broken", "texts mismatched", "unbilled",
             "largest RSS growth"]]
    for run, source in zip(runs, TABLES["chaos"].sources):
        soak = run["soak_minutes"] > 0
        counts = {label: run[key] for key, label in FAULTS}
        if len(set(counts.values())) == 1:
            faults = f"{run['hangs']} each of worker, scheduler and router kills, hangs, loss, partitions, delays"
        else:
            faults = ", ".join(f"{label} {n}" for label, n in counts.items() if n)
            if not any(run[key] for key in ("worker_kills", "scheduler_kills", "router_kills")):
                faults += " (no kills: memory is followed per process)"
        growth = f"{run['rss_growth_pct']:.1f}% ({run['rss_growth_process']})"
        # Runs recorded before the JSON named its dtype ran fp32: the CPU engine had no other then.
        dtype = DTYPE_LABELS[run.get("dtype", "float32")]
        # Runs recorded before the JSON said whether the workers were batch-invariant: fp32 only.
        invariant = run.get("batch_invariant", dtype == "fp32")
        model = "SmolLM2" if "SmolLM2" in run.get("model", "") else "bench model"
        broken = f"{num(run['continuations_broken'])} of {num(run['continuations_checked'])}" \
            if "continuations_checked" in run else "not checked (texts compared)"
        rows.append([f"{'soak' if soak else 'default'}, {run['minutes']:g} min ([{source}](../{RESULTS}/{source}))",
                     f"{dtype}, {model}", faults,
                     *(num(run[key]) for key in ("submitted", "completed", "failed", "lost", "failed_on_killed_router")),
                     broken, num(run["texts_mismatched"]) + ("" if invariant else " (not expected 0)"),
                     num(run["unbilled"]), growth if soak else f"{growth}, with processes restarted: not a soak"])
    return rows


@table("dtype-divergence", "dtype_divergence.json")
def dtype_divergence(result: dict) -> list[list[str]]:
    rows = [["dtype", "disturbance", "texts identical", "texts parted", "first parted at token (min / median)",
             "continuations broken"]]
    dtypes = [d for d in ("fp32", "bf16") if d in result]
    for dtype in dtypes:
        for kind, what in (("batched", "batched with the others, prompts chunked"),
                           ("recomputed", "prompt + first k tokens recomputed, then the rest")):
            r = result[dtype][kind]
            first = "—" if not r["texts_diverged"] else \
                f"{r['first_divergence_token_min']} / {r['first_divergence_token_median']}"
            rows.append([dtype, what, f"{r['texts_identical']} of {r['continuations_checked']}",
                         num(r["texts_diverged"]), first,
                         f"{r['continuations_broken']} of {r['continuations_checked']}"])
    return rows


def render_table(name: str) -> str:
    """The marker, the table from its JSON files as they are now, and the closing marker."""
    spec = TABLES[name]
    loaded = [json.loads((ROOT / RESULTS / source).read_text()) for source in spec.sources]
    return f"{spec.marker()}\n\n{markdown(spec.render(*loaded))}\n\n<!-- /table -->"


def render_page(text: str) -> str:
    """`text` with every marked table rendered again; a marker naming no known table is an error."""
    def replace(match: re.Match) -> str:
        if match["name"] not in TABLES:
            raise ValueError(f"no table {match['name']!r} in bench/perf_doc.py")
        return render_table(match["name"])
    return BLOCK.sub(replace, text)


def tables_in(text: str) -> list[str]:
    return [match["name"] for match in BLOCK.finditer(text)]


def unrendered_tables(text: str) -> list[str]:
    """The header row of each markdown table outside the markers (written by hand)."""
    outside = BLOCK.sub("", text)
    return [line for line, following in zip(outside.splitlines(), outside.splitlines()[1:])
            if line.startswith("|") and re.fullmatch(r"\|(-+\|)+", following)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 if a page's tables differ from their JSON")
    mode.add_argument("--write", action="store_true", help="rewrite the pages' tables from their JSON")
    args = parser.parse_args()
    stale = []
    for page in PAGES:
        path = ROOT / page
        text = path.read_text()
        rendered = render_page(text)
        if rendered == text:
            continue
        if args.write:
            path.write_text(rendered)
            print(f"wrote {page}")
        else:
            stale += [f"{page}: {name}" for name in tables_in(text) if render_table(name) not in text]
    if stale:
        print("tables that differ from their JSON (python -m bench.perf_doc --write):\n  " + "\n  ".join(stale))
        sys.exit(1)


if __name__ == "__main__":
    main()
