"""The QoS benchmark's report (bench/qos_report.py): High's first token split into its parts, and
the table that prints them."""
from __future__ import annotations

import math

from bench.loadgen import Outcome
from bench.qos_report import KEYS, print_table, summarise, ttft_parts


def high(ttft: float, server_ttft: float, server_queue: float) -> Outcome:
    return Outcome("high", True, ttft_ms=ttft, server_ttft_ms=server_ttft, server_queue_ms=server_queue,
                   tokens=1, done_at=1.0)


def test_ttft_parts_split_each_request_into_wait_step_and_the_rest():
    outcomes = [high(30, 20, 5), high(100, 70, 40), high(60, 50, 10)]
    # Per request: wait 5 / 40 / 10, step 15 / 30 / 40, the rest 10 / 30 / 10; each part's own
    # quantile over the requests (nearest rank), not the parts of one request.
    assert ttft_parts(outcomes, 0.99) == [40, 40, 30]
    assert ttft_parts(outcomes, 0.5) == [10, 30, 10]


def test_ttft_parts_are_nan_without_the_schedulers_timings():
    outcomes = [Outcome("high", True, ttft_ms=30, server_ttft_ms=math.nan, server_queue_ms=math.nan)]
    wait, step, rest = ttft_parts(outcomes, 0.99)
    assert math.isnan(wait) and math.isnan(step) and math.isnan(rest)
    assert all(math.isnan(p) for p in ttft_parts([], 0.5))


def test_the_table_prints_the_parts_side_by_side(capsys):
    def column(outcomes):
        summary = summarise(outcomes, low_kv_peak_blocks=0, total_blocks=100)
        summary.update(wall_s=1.0, preemptions=0, cut_ins=0, recompute_share=0.0, idle_high_p50_ttft_ms=25.0,
                       idle_high_p50_ttft_parts_ms=[5.0, 15.0, 5.0],
                       high_p99_ttft_over_idle=summary["high_p99_ttft_ms"] / 25.0)
        return summary

    report = {"workload": "w", "requests": "r", "model": "m", "machine": "here",
              "fcfs": column([high(900, 880, 860)]), "qos": column([high(100, 70, 40)])}
    assert {key for key, _, _ in KEYS} <= set(report["qos"])
    print_table(report)
    lines = {line[:26].strip(): line[26:].split() for line in capsys.readouterr().out.splitlines()}
    assert lines["High P99 wait/step/rest"] == ["860/20/20", "40/30/30"]
    assert lines["idle P50 wait/step/rest"] == ["5/15/5", "5/15/5"]


def test_the_report_says_how_late_the_load_was_sent_and_where_it_ran(capsys):
    outcomes = [Outcome("low", True, tokens=1, done_at=1.0, send_lag_ms=lag) for lag in (0.0, 50.0, 300.0)]
    summary = summarise(outcomes, low_kv_peak_blocks=0, total_blocks=100)
    assert summary["send_lag_ms"] == [50.0, 300.0]          # P50 (nearest rank) and the latest
    summary.update(wall_s=1.0, preemptions=0, cut_ins=0, recompute_share=0.0, idle_high_p50_ttft_ms=25.0,
                   idle_high_p50_ttft_parts_ms=[5.0, 15.0, 5.0], high_p99_ttft_over_idle=float("nan"))
    print_table({"workload": "w", "requests": "r", "model": "m", "machine": "here", "policies": ["fcfs", "qos"],
                 "fcfs": summary,
                 "qos": summary})
    out = capsys.readouterr().out
    assert [line.split()[-2:] for line in out.splitlines() if line.startswith("sent late")] == [["50/300", "50/300"]]
