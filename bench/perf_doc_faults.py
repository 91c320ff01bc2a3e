"""The fault simulator's table in docs/operations.md (tests/sim's long run, bench/results/fault_sim.json).
Registered by bench/perf_doc.py, which renders and checks every table."""
from __future__ import annotations

from bench.perf_doc_format import RESULTS, num


def fault_sim(result: dict) -> list[list[str]]:
    faults = ", ".join(f"{kind.replace('_', ' ')} {num(n)}" for kind, n in
                       sorted(result["faults"].items(), key=lambda kv: -kv[1]))
    failed = num(result["failed"]) if not result["failed"] else \
        f"{num(result['failed'])} (seeds {', '.join(str(f['seed']) for f in result['failed_seeds'][:5])})"
    return [["seeds", "runs", "failed", "wall time (processes, cores)", "virtual time", "steps",
             "requests (completed)", "faults injected"],
            [f"{result['seeds']} ([fault_sim.json](../{RESULTS}/fault_sim.json))", num(result["runs"]), failed,
             f"{num(result['seconds'])} s ({result['jobs']}, {result['cores']})",
             f"{num(result['virtual_seconds'] / 3600, 1)} h", num(result["steps"]),
             f"{num(result['clients'])} ({num(result['completed'])})", faults]]
