"""Run simulator seeds from the command line.

    python -m tests.sim.replay --seed 1234            one run: its faults, outcome and trace digest
    python -m tests.sim.replay --seed 1234 --log      ... with the scheduler's log (virtual times)
    python -m tests.sim.replay --seeds 0:100000 --jobs 2 --json bench/results/fault_sim.json
    ... --tiers                                       workers with second KV tiers
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import sys
import time

from tests.sim.run import simulate


def run_range(bounds: tuple[int, int, bool]) -> list:
    return [simulate(seed, tiers=bounds[2]) for seed in range(*bounds[:2])]


def many(start: int, stop: int, jobs: int, every=None, tiers: bool = False) -> tuple[list, float]:
    """Seeds start..stop on `jobs` processes; `every(outcomes, seconds)` after each chunk."""
    began = time.perf_counter()
    chunk = 200
    ranges = [(s, min(s + chunk, stop), tiers) for s in range(start, stop, chunk)]
    outcomes = []
    with multiprocessing.Pool(jobs) as pool:
        for done, part in enumerate(pool.imap(run_range, ranges)):
            outcomes.extend(part)
            for o in part:
                if not o.ok:
                    print(f"FAIL seed {o.seed}: {o.failure}\n  replay: {o.replay()}", flush=True)
            if every is not None:
                every(outcomes, time.perf_counter() - began)
            if done % 25 == 0:
                print(f"{len(outcomes)} seeds, {sum(not o.ok for o in outcomes)} failed, "
                      f"{time.perf_counter() - began:.0f} s", flush=True)
    return outcomes, time.perf_counter() - began


def summary(outcomes: list, seconds: float, start: int, stop: int, jobs: int) -> dict:
    failed = [o for o in outcomes if not o.ok]
    faults: dict[str, int] = {}
    for o in outcomes:
        for kind, n in o.faults.items():
            faults[kind] = faults.get(kind, 0) + n
    return {
        "what": "tests/sim: the real scheduler of one pool against simulated workers and clients, "
                "faults drawn from each seed; invariants checked after every event-loop iteration",
        "command": f"python -m tests.sim.replay --seeds {start}:{stop} --jobs {jobs}",
        "seeds": f"{start}:{start + len(outcomes)}", "runs": len(outcomes), "complete": len(outcomes) == stop - start,
        "failed": len(failed), "failed_seeds": [{"seed": o.seed, "failure": o.failure} for o in failed[:50]],
        "seconds": round(seconds, 1), "jobs": jobs, "cores": multiprocessing.cpu_count(),
        "virtual_seconds": round(sum(o.virtual_s for o in outcomes)),
        "steps": sum(o.steps for o in outcomes), "clients": sum(o.clients for o in outcomes),
        "completed": sum(o.completed for o in outcomes), "faults": dict(sorted(faults.items())),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--seeds", help="START:STOP")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", help="write the many-seed summary here")
    parser.add_argument("--log", action="store_true", help="show the scheduler's log (one seed)")
    parser.add_argument("--tiers", action="store_true", help="workers with second KV tiers")
    args = parser.parse_args(argv)
    if args.seed is not None:
        if args.log:
            logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
        outcome = simulate(args.seed, log_level=logging.NOTSET - 1 if args.log else logging.CRITICAL, tiers=args.tiers)
        print(json.dumps(outcome.__dict__, indent=1))
        print("ok" if outcome.ok else f"FAILED: {outcome.failure}")
        return 0 if outcome.ok else 1
    start, stop = map(int, args.seeds.split(":"))

    def write(outcomes, seconds):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary(outcomes, seconds, start, stop, args.jobs), f, indent=1)
                f.write("\n")
    outcomes, seconds = many(start, stop, args.jobs, write, args.tiers)
    write(outcomes, seconds)
    result = summary(outcomes, seconds, start, stop, args.jobs)
    print(json.dumps({k: v for k, v in result.items() if k != "failed_seeds"}, indent=1))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
