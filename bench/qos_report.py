"""The QoS benchmark's results (bench/qos_burst.py): the summary figures of one policy's run, the
FCFS-vs-QoS table, one CSV row per request, and the plots (TTFT CDF, KV blocks and queue depth
over time, per priority).
"""
from __future__ import annotations

import csv
import math
import textwrap
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

from bench.harness import PRIORITIES, quantile
from bench.loadgen import Outcome


@dataclass(slots=True)
class Sample:
    """The pool's stats at one moment of a run."""
    at: float                                     # seconds after the common start
    kv: dict = field(default_factory=dict)        # priority -> blocks
    waiting: dict = field(default_factory=dict)   # priority -> requests
    total_blocks: int = 0


def write_outcomes(outcomes: list[Outcome], path: Path) -> Path:
    """One CSV row per request (times in ms, sent/done in seconds after the start)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in fields(Outcome)]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        for outcome in sorted(outcomes, key=lambda o: o.sent_at):
            writer.writerow([getattr(outcome, name) for name in names])
    return path


def ttft_parts(outcomes: list[Outcome], q: float) -> list[float]:
    """The q-quantile of each part of these requests' TTFT (ms): waiting at the scheduler to be
    scheduled, from then to the first token there, and the rest (router, client, the hops)."""
    parts = [(o.server_queue_ms, o.server_ttft_ms - o.server_queue_ms, o.ttft_ms - o.server_ttft_ms)
             for o in outcomes]
    return [quantile([p[i] for p in parts], q) for i in range(3)]


def summarise(outcomes: list[Outcome], low_kv_peak_blocks: int, total_blocks: int) -> dict:
    def of(priority):
        return [o for o in outcomes if o.priority == priority]

    ok = {p: [o for o in of(p) if o.ok] for p in PRIORITIES}
    low_done = max((o.done_at for o in ok["low"]), default=0.0)
    return {
        "high_p99_ttft_ms": quantile([o.ttft_ms for o in ok["high"]], 0.99),
        "high_p99_e2e_ms": quantile([o.e2e_ms for o in ok["high"]], 0.99),
        # Where High's time goes: the scheduler's own view, without the gRPC hops and client.
        "high_p99_server_ttft_ms": quantile([o.server_ttft_ms for o in ok["high"]], 0.99),
        # Where a High request's first token goes, each part's P99 over the requests: waiting at
        # the scheduler to be scheduled (the step in flight, the loop), from there to its first
        # token (its own step), and outside the scheduler (router, client, the hops).
        "high_p99_ttft_parts_ms": ttft_parts(ok["high"], 0.99),
        "high_p50_ttft_ms": quantile([o.ttft_ms for o in ok["high"]], 0.5),
        "high_success_rate": len(ok["high"]) / max(1, len(of("high"))),
        "medium_p99_ttft_ms": quantile([o.ttft_ms for o in ok["medium"]], 0.99),
        "low_tok_s": sum(o.tokens for o in ok["low"]) / low_done if low_done else 0.0,
        "low_kv_peak_frac": low_kv_peak_blocks / total_blocks if total_blocks else 0.0,
        # How late the load generator sent the requests (P50, max over all of them): a burst sent
        # late reaches the service gentler than the workload describes.
        "send_lag_ms": [quantile([o.send_lag_ms for o in outcomes], 0.5), max((o.send_lag_ms for o in outcomes),
                                                                            default=float("nan"))],
        **{f"rejected_{p}": sum(1 for o in of(p) if o.code == "RESOURCE_EXHAUSTED") for p in PRIORITIES},
        "failed_other": sum(1 for o in outcomes if not o.ok and o.code != "RESOURCE_EXHAUSTED"),
        "failed_codes": dict(Counter(f"{o.priority}:{o.code}" for o in outcomes
                                     if not o.ok and o.code != "RESOURCE_EXHAUSTED")),
    }


KEYS = [("high_p99_ttft_ms", "High P99 TTFT (ms)", "{:.0f}"),
        ("high_p50_ttft_ms", "High P50 TTFT (ms)", "{:.0f}"),
        ("idle_high_p50_ttft_ms", "High P50 TTFT, idle (ms)", "{:.0f}"),
        ("high_p99_ttft_over_idle", "High P99 / idle P50", "{:.2f}"),
        ("high_p99_server_ttft_ms", "High P99 TTFT at scheduler", "{:.0f}"),
        ("high_p99_ttft_parts_ms", "High P99 wait/step/rest", "{:.0f}/{:.0f}/{:.0f}"),
        ("idle_high_p50_ttft_parts_ms", "idle P50 wait/step/rest", "{:.0f}/{:.0f}/{:.0f}"),
        ("high_p99_e2e_ms", "High P99 e2e (ms)", "{:.0f}"),
        ("high_success_rate", "High success rate", "{:.1%}"), ("medium_p99_ttft_ms", "Medium P99 TTFT (ms)", "{:.0f}"),
        ("low_tok_s", "Low throughput (tok/s)", "{:.0f}"), ("low_kv_peak_frac", "Low KV peak (% blocks)", "{:.1%}"),
        ("rejected_high", "rejected High", "{}"), ("rejected_medium", "rejected Medium", "{}"),
        ("rejected_low", "rejected Low", "{}"), ("preemptions", "preemptions", "{}"),
        ("cut_ins", "cut-in steps", "{}"), ("recompute_share", "recomputed / computed", "{:.1%}"),
        ("wall_s", "wall time (s)", "{:.0f}"), ("send_lag_ms", "sent late, P50/max (ms)", "{:.0f}/{:.0f}")]


def print_table(report: dict) -> None:
    print(f"\nworkload {report['workload']}: {report['requests']}; model {report['model']}; "
          f"front {report.get('front', 'grpc')}; {report['machine']}")
    print()
    # Variants of QoS (qos-elastic, qos-wfq, ...) get a column each after the comparison.
    extra = [name for name in report.get("policies", []) if name not in ("fcfs", "qos")]
    print(f"{'':<26}{'FCFS':>12}{'QoS':>12}{'change':>14}" + "".join(f"{name:>14}" for name in extra))
    for key, label, fmt in KEYS:
        a, b = report["fcfs"][key], report["qos"][key]
        change = ""
        if isinstance(a, float) and isinstance(b, float) and a and b and math.isfinite(a / b) \
                and key != "high_success_rate":
            # Big drops read better as "how many times lower" than as 0.00x.
            change = f"{a / b:,.0f}x lower" if a / b >= 10 else f"{b / a:.2f}x"
        print(f"{label:<26}{cell(fmt, a):>12}{cell(fmt, b):>12}{change:>14}"
              + "".join(f"{cell(fmt, report[name][key]):>14}" for name in extra))


def cell(fmt: str, value) -> str:
    return fmt.format(*value) if isinstance(value, list) else fmt.format(value)


def plot(report: dict, runs: dict[str, tuple[list[Outcome], list[Sample]]], directory: Path) -> list[Path]:
    """The three PNGs comparing the "fcfs" and "qos" runs; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    colors = {"high": "tab:red", "medium": "tab:orange", "low": "tab:blue"}
    paths = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, style in (("fcfs", "--"), ("qos", "-")):
        for priority in PRIORITIES:
            values = sorted(o.ttft_ms for o in runs[policy][0] if o.ok and o.priority == priority)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], style,
                        color=colors[priority], label=f"{priority} ({policy})")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    # Wrapped: a steady or trace workload's description is longer than the figure is wide.
    ax.set_title(textwrap.fill(f"TTFT CDF, {report['workload']}, {report['model']}", 90), fontsize=9)
    ax.axvline(200, color="grey", lw=0.8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(directory / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    for key, ylabel, name in (("kv", "KV blocks held (% of pool)", "kv_blocks.png"),
                              ("waiting", "requests waiting", "queue_depth.png")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, policy in zip(axes, ("fcfs", "qos")):
            samples = runs[policy][1]
            xs = [s.at for s in samples]
            for priority in PRIORITIES:
                ys = [getattr(s, key).get(priority, 0) * (100 / s.total_blocks if key == "kv" and s.total_blocks else 1)
                      for s in samples]
                ax.plot(xs, ys, color=colors[priority], label=priority)
            if key == "kv":
                ax.axhline(30, color="tab:blue", lw=0.8, ls=":", label="Low cap 30%")
            ax.set_title(policy)
            ax.set_xlabel("seconds")
        axes[0].set_ylabel(ylabel)
        axes[1].legend(fontsize=8)
        fig.tight_layout()
        paths.append(directory / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
