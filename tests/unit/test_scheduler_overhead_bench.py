"""bench/scheduler_overhead.py runs, on a small pool, and reports what it says it does: plan,
postprocess and streaming times, admissions, and the fixed task's tail beside them."""
from __future__ import annotations

import math

from bench.harness import FixedTask
from bench.scheduler_overhead import measure


def test_a_small_run_reports_every_figure_and_keeps_the_pool_busy():
    result = measure("qos", running=16, queued=40, tenants=5, steps=60, label="test")
    for part in ("", "postprocess_", "streaming_"):
        assert 0 < result[f"{part}p50_us"] <= result[f"{part}p99_us"]
    assert result["steps"] == 60 and result["admitted_per_step"] > 0    # requests finish and are replaced
    assert result["fixed_task_p50_us"] > 0 and result["fixed_task_p99_over_p50"] >= 1.0


def test_the_fixed_task_times_only_what_it_ran():
    task = FixedTask()
    assert math.isnan(task.tail_ratio())        # nothing timed yet: nan, as quantile() gives, not 0
    for _ in range(5):
        task.run()
    assert len(task.samples_us) == 5 and task.tail_ratio() >= 1.0


def test_two_trees_are_stepped_in_turn_in_one_process(tmp_path):
    # The same tree on both sides: each pool really steps (its own modules, loaded apart), and the
    # report names both trees' figures and the ratio.
    import json
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, str(repo / "bench" / "scheduler_ab.py"), str(repo), str(repo), "--steps", "40",
                    "--running", "16", "--queued", "40", "--json", str(out)], check=True, capture_output=True,
                   timeout=120)
    result = json.loads(out.read_text())
    assert result["steps"] == 40 and result["base"] == result["new"] == str(repo)
    for part in ("plan", "postprocess"):
        assert 0 < result[part]["base"]["p50_us"] <= result[part]["base"]["p99_us"]
        assert 0 < result[part]["new"]["p50_us"] <= result[part]["new"]["p99_us"]
        assert result[part]["median_step_ratio"] > 0
