#!/usr/bin/env python
"""Two commits on the same burst, paired: did a change make High's tail or Low's throughput worse?

Checks out each commit into a git worktree of its own (under --workdir), then runs
bench/qos_burst.py (FCFS and QoS, the same requests) from each in turn, alternating which goes
first, for --pairs pairs, and reports per figure the median paired ratio new / old with a
bootstrap 95% interval (pairs resampled): High's P99 TTFT over its idle P50 (QoS), Low's tok/s
under QoS and under FCFS, Low's KV peak under QoS, High's P99 under FCFS (the baseline, which
neither commit's QoS mechanisms touch: how much the host alone moves a figure) and High's idle
P50 TTFT (requests one at a time before the burst: an engine change shows there first).

    python bench/paired_commits.py OLD NEW [--pairs 4] [--json PATH] -- [qos_burst.py options]

e.g. `python bench/paired_commits.py 67204df HEAD --pairs 4 --json bench/results/paired_burst.json
-- --scale 0.25`. Each run's own JSON stays under --workdir.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import machine, median_ci, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# (report key, the figure in qos_burst's JSON as (policy, key))
FIGURES = {
    "qos_high_p99_over_idle": ("qos", "high_p99_ttft_over_idle"),
    "qos_high_p99_ttft_ms": ("qos", "high_p99_ttft_ms"),
    "qos_low_tok_s": ("qos", "low_tok_s"),
    "qos_low_kv_peak_frac": ("qos", "low_kv_peak_frac"),
    "fcfs_high_p99_ttft_ms": ("fcfs", "high_p99_ttft_ms"),
    "fcfs_low_tok_s": ("fcfs", "low_tok_s"),
    "qos_high_idle_p50_ttft_ms": ("qos", "idle_high_p50_ttft_ms"),    # an engine change shows here first
}


def worktree(commit: str, workdir: Path) -> tuple[Path, str]:
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = workdir / sha
    if not path.exists():
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=True)    # one removed by hand
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return path, sha


def run_burst(tree: Path, out: Path, burst_args: list[str]) -> dict:
    """qos_burst.py from `tree` (its own code: cwd and the script's path), FCFS then QoS."""
    command = [sys.executable, "bench/qos_burst.py", "--policies", "fcfs,qos", "--json", str(out),
               "--plots", str(out.parent / out.stem), *burst_args]
    started = time.time()
    subprocess.run(command, cwd=tree, check=True)
    print(f"  {tree.name}: {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    return json.loads(out.read_text())


def compare(pairs: list[tuple[dict, dict]]) -> dict:
    """Per figure: old and new values, the median new/old ratio and its 95% interval."""
    rows = {}
    for name, (policy, key) in FIGURES.items():
        old = [o[policy][key] for o, _ in pairs]
        new = [n[policy][key] for _, n in pairs]
        ratio, low, high = median_ci([b / a if a else math.nan for a, b in zip(old, new)])
        rows[name] = {"old": old, "new": new, "ratio": ratio, "ci_low": low, "ci_high": high}
    return rows


def main() -> None:
    argv = sys.argv[1:]
    burst_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qos-paired"))
    args = parser.parse_args(own)
    args.workdir.mkdir(parents=True, exist_ok=True)
    (old_tree, old_sha), (new_tree, new_sha) = worktree(args.old, args.workdir), worktree(args.new, args.workdir)
    pairs = []
    for index in range(args.pairs):
        order = [("old", old_tree), ("new", new_tree)]
        if index % 2:
            order.reverse()
        print(f"pair {index + 1}/{args.pairs}", file=sys.stderr, flush=True)
        result = {side: run_burst(tree, args.workdir / f"{side}-{index + 1}.json", burst_args) for side, tree in order}
        pairs.append((result["old"], result["new"]))
        report = {"machine": machine(), "old": old_sha, "new": new_sha, "burst_args": burst_args,
                  "workload": pairs[0][0]["workload"], "requests": pairs[0][0]["requests"],
                  "pairs": len(pairs), "figures": compare(pairs)}
        write_json(args.json, report)
    print(f"\n{old_sha} -> {new_sha}, {len(pairs)} pairs ({' '.join(burst_args) or 'full scale'})")
    print("| figure | old (each pair) | new (each pair) | new / old, median [95% CI] |")
    print("|---|---|---|---|")
    for name, row in report["figures"].items():
        print(f"| {name} | {', '.join(f'{v:.3g}' for v in row['old'])} | {', '.join(f'{v:.3g}' for v in row['new'])} "
              f"| {row['ratio']:.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}] |")


if __name__ == "__main__":
    main()
