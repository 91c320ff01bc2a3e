"""What every benchmark script shares: its argument parser, the JSON result, percentiles, and a
description of the machine with a calibration figure.

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # in the script, first
    from bench.harness import make_parser, quantile, write_json
    parser = make_parser(__doc__, seed=True)       # --json PATH (and --seed); -h shows the docstring
    args = parser.parse_args()
    ...
    write_json(args.json, {"p99_us": quantile(times_us, 0.99), "python_loop_ns": python_loop_ns()})

Torch-free: router_decision.py and scheduler_overhead.py must not import torch, so the CPU's name
(services.engine.device.CpuBackend, which imports torch) is only looked up when asked for.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

from services.common.percentile import percentile

PRIORITIES = ("high", "medium", "low")    # the x-priority values the benchmarks send, most urgent first
LOOP_ITERATIONS = 1_000_000               # python_loop_ns(): iterations per timed run
LOOP_REPEATS = 3                          # ... and the best of this many runs


def make_parser(doc: str | None, *, seed: bool = False) -> argparse.ArgumentParser:
    """A parser whose -h text is the script's docstring (layout kept), with --json PATH and, when
    `seed`, --seed N (default 0)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results to this JSON file")
    if seed:
        parser.add_argument("--seed", type=int, default=0, help="random seed of the workload")
    return parser


def model_or_bench(model: str | None) -> str:
    """The --model folder ("default": the embedded SmolLM2), else the random-weight bench model
    (made once, cached)."""
    if model:
        from services.local.cluster import resolve_model
        return resolve_model(model)
    from services.engine.bench_model import bench_model_dir
    return str(bench_model_dir())


def source_at(commit: str, source: Path, workdir: Path) -> Path:
    """`source` (a file of this checkout) as `commit` wrote it, copied into `workdir` (for a
    benchmark that builds another commit's kernel beside this checkout's)."""
    root = Path(__file__).resolve().parent.parent
    relative = source.resolve().relative_to(root).as_posix()
    text = subprocess.run(["git", "show", f"{commit}:{relative}"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    path = workdir / f"{source.stem}_{commit.replace('/', '_')}{source.suffix}"
    path.write_text(text)
    return path


def write_json(path: Path | None, result: dict) -> None:
    """Write `result` to `path` (folders created, indented, trailing newline) and say so; nothing
    when `path` is None (no --json given)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def quantile(values: Iterable[float], q: float) -> float:
    """The nearest-rank percentile of services/common/percentile.py, q in [0, 1] (0.5 for P50,
    0.99 for P99); NaN when there are no values, so that a class with no answers shows as nan
    rather than as 0 ms."""
    return percentile(values, q, math.nan)


def bootstrap_interval(values: list[float], q: float, rounds: int = 1000, level: float = 0.9,
                       seed: int = 0) -> tuple[float, float]:
    """How far the quantile q of `values` could be from the same quantile of another run of the
    same system, from sampling alone: the central `level` interval of the quantile over `rounds`
    resamples with replacement. A P99 over a hundred values is its worst one or two; this says
    how much that moves."""
    if not values:
        return math.nan, math.nan
    rng = random.Random(seed)
    ordered = sorted(values)
    n = len(ordered)
    rank = max(1, math.ceil(q * n))                   # nearest rank, as quantile()
    # Values sorted, so a resample's rank-th smallest value is that of its rank-th smallest index.
    estimates = sorted(ordered[sorted(rng.randrange(n) for _ in range(n))[rank - 1]] for _ in range(rounds))
    tail = (1 - level) / 2
    return estimates[int(tail * rounds)], estimates[min(rounds - 1, int((1 - tail) * rounds))]


def progress(total: int, desc: str, unit: str = "req") -> tqdm:
    """A progress bar on stderr, so that stdout holds only the results."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


def cpu_name() -> str:
    """The CPU's model name, as the worker reports it (CpuBackend.name). Imports torch."""
    from services.engine.device import CpuBackend
    return CpuBackend().name


def machine(cpu: bool = True) -> str:
    """One line: the CPU (its model name, or with cpu=False only the architecture, which needs no
    torch), the cores this process may use, and the Python version."""
    name = cpu_name() if cpu else platform.machine() or "unknown CPU"
    return f"{name}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}"


def python_loop_ns(iterations: int = LOOP_ITERATIONS, repeats: int = LOOP_REPEATS) -> float:
    """Calibration: nanoseconds per iteration of `for i in range(n): x += i`, the best of `repeats`
    runs of `iterations` each (the best, since interference only ever adds time).

    Overhead benchmarks measure pure-Python code, so their figures move with the interpreter's
    speed on the machine; each one measures this in the same run and reports it beside its result
    (JSON key "python_loop_ns"), so that results from different machines can be compared."""
    best = math.inf
    for _ in range(repeats):
        x = 0
        started = time.perf_counter_ns()
        for i in range(iterations):
            x += i
        best = min(best, time.perf_counter_ns() - started)
    return best / iterations


class FixedTask:
    """Calibration for tail figures: one fixed pure-Python task (a pass over 256 small objects,
    eight times: a few hundred microseconds, about a step plan's size), timed between a
    benchmark's own timed steps. The same work every time, so its p99 over its p50 is what this
    machine adds to a tail by itself in this run (other tenants, caches, interrupts): on this
    project's 2-core machine ~1.5 on 2026-12-01. An overhead benchmark prints it beside its own
    p99/p50, which is the task's share plus the variation of the work it measures."""

    def __init__(self) -> None:
        self._objects = [{"a": i, "b": 2 * i} for i in range(256)]
        self.samples_us: list[float] = []

    def run(self) -> None:
        objects, total = self._objects, 0
        started = time.perf_counter_ns()
        for _ in range(8):
            for item in objects:
                total += item["a"] + item["b"]
        self.samples_us.append((time.perf_counter_ns() - started) / 1000)

    def p50_us(self) -> float:
        return quantile(self.samples_us, 0.5)

    def tail_ratio(self) -> float:
        """p99 / p50 of the task's times."""
        return quantile(self.samples_us, 0.99) / self.p50_us()


def calibration_line(loop_ns: float) -> str:
    return f"calibration: {loop_ns:.1f} ns per pure-Python loop iteration on this machine (python_loop_ns)"


def median_ci(ratios: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median, bootstrap 95% interval of the median) of paired ratios, the pairs resampled; ratios
    that are not finite (a pair with nothing to divide by) left out. For paired on/off or old/new
    runs (bench/ablation.py, bench/paired_commits.py)."""
    ratios = [r for r in ratios if math.isfinite(r)]
    if not ratios:
        return math.nan, math.nan, math.nan
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(rounds))
    return statistics.median(ratios), medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]
