#!/usr/bin/env python
"""Two versions of the scheduler, side by side in one process: the headline of
bench/scheduler_overhead.py (256 running, 1,000 queued, 50 tenants) for the code in two source
trees, stepped in turn, one step of each at a time.

This machine's speed drifts by up to 2x within minutes (docs/performance.md),
so two runs of the overhead benchmark one after the other compare the machine's moments as much
as the code. Here both versions share each moment: their steps alternate (which goes first
alternates too), and the figure to read is the median over steps of the ratio of the new tree's
step to the base tree's, beside each tree's own p50 and p99 (those still move with the machine).
Both trees' pools live in one process, so each runs slower than alone (more memory in use); the
ratio is what counts. The same tree on both sides gives 1.00 within ~1% (2026-12-02).

    git worktree add /tmp/base <commit>        # the version to compare against
    python bench/scheduler_ab.py /tmp/base [NEW_TREE] [--steps 2000] [--running 256] [--queued 1000]
                                 [--json PATH]

NEW_TREE defaults to this checkout. Both trees need bench/scheduler_overhead.py's OverheadRun
(2026-12-02 on). They share one copy of the protobuf modules (one descriptor pool per process):
NEW_TREE's, loaded first, so its protos must be a superset of BASE's (fields added, none removed,
as the contract's evolution allows).
"""
from __future__ import annotations

import asyncio
import importlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import calibration_line, make_parser, python_loop_ns, quantile, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHARED = "services.common.proto"       # loaded once, from the first tree


def load_tree(tree: Path):
    """The tree's bench/scheduler_overhead module, with the services it imports from that tree."""
    for name in list(sys.modules):
        top = name.split(".")[0]
        if top in ("services", "bench") and not name.startswith(SHARED):
            del sys.modules[name]
    sys.path.insert(0, str(tree))
    try:
        module = importlib.import_module("bench.scheduler_overhead")
    finally:
        sys.path.remove(str(tree))
    if not hasattr(module, "OverheadRun"):
        raise SystemExit(f"{tree}: bench/scheduler_overhead.py has no OverheadRun (a tree from before 2026-12-02)")
    return module


def summary(values_us: list[float]) -> dict:
    return {"p50_us": quantile(values_us, 0.5), "p99_us": quantile(values_us, 0.99)}


async def compare(runs: list, steps: int) -> list[list[tuple[float, float]]]:
    """(plan, postprocess) seconds per step for each run, the runs stepped in turn."""
    for run in runs:
        await run.warm_up()
        for _ in range(min(steps, 200)):        # past the first admissions' wave
            await run.step()
    times: list[list[tuple[float, float]]] = [[] for _ in runs]
    for i in range(steps):
        for k in (range(len(runs)) if i % 2 == 0 else reversed(range(len(runs)))):
            plan, post, _ = await runs[k].step()
            times[k].append((plan, post))
        if (i + 1) % 500 == 0:
            print(f"  {i + 1} / {steps} steps", file=sys.stderr)
    return times


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("base", type=Path, help="source tree of the version to compare against")
    parser.add_argument("new", type=Path, nargs="?", default=REPO, help="source tree of the new version")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--running", type=int, default=256, help="(smaller for a quick check)")
    parser.add_argument("--queued", type=int, default=1000)
    args = parser.parse_args()
    trees = [args.base.resolve(), args.new.resolve()]
    modules = [load_tree(trees[1]), load_tree(trees[0])][::-1]      # the new tree's protos first
    runs = [module.OverheadRun("qos", args.running, args.queued, 50) for module in modules]
    times = asyncio.run(compare(runs, args.steps))
    result = {"steps": args.steps, "running": args.running, "queued": args.queued,
              "base": str(trees[0]), "new": str(trees[1])}
    for label, part in (("plan", 0), ("postprocess", 1)):
        base_us = [t[part] * 1e6 for t in times[0]]
        new_us = [t[part] * 1e6 for t in times[1]]
        ratio = statistics.median(n / b for b, n in zip(base_us, new_us) if b > 0)
        result[label] = {"base": summary(base_us), "new": summary(new_us), "median_step_ratio": ratio}
        print(f"{label:>12}: base p50 {result[label]['base']['p50_us']:.0f} us, p99 "
              f"{result[label]['base']['p99_us']:.0f} us | new p50 {result[label]['new']['p50_us']:.0f} us, "
              f"p99 {result[label]['new']['p99_us']:.0f} us | new / base, median over steps: {ratio:.3f}")
    loop_ns = python_loop_ns()
    result["python_loop_ns"] = loop_ns
    print(calibration_line(loop_ns))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
