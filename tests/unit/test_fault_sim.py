"""The pool's scheduler under simulated faults (tests/sim): every invariant holds over thousands
of seeds; one seed replays one run exactly; each bug the simulator found stays fixed (its seed,
and the same seed failing with the fix taken out); each mutation of the table in
docs/operations.md is caught by the seeds it names.

A failing seed prints the command that replays it: python -m tests.sim.replay --seed N.
QOS_SIM_SEEDS sets how many seeds the fast test runs (2,000 by default, ~1-2 minutes on two cores);
the long test runs only when QOS_SIM_SLOW_SEEDS is set (N more seeds); bench/results/fault_sim.json
has a longer run (python -m tests.sim.replay --seeds A:B --jobs 2).
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from services.scheduler.cut_in_dispatch import CutInDispatch
from services.scheduler.failover import WorkerChanges
from services.scheduler.prefix_cache import PrefixCache
from tests.sim.mutations import MUTATIONS
from tests.sim.run import simulate

SEEDS = int(os.environ.get("QOS_SIM_SEEDS", "2000"))
SLOW_SEEDS = int(os.environ.get("QOS_SIM_SLOW_SEEDS", "0"))
TIER_SEEDS = int(os.environ.get("QOS_SIM_TIER_SEEDS", "500"))


def _run(bounds: tuple[int, int, bool]) -> list:
    return [simulate(seed, tiers=bounds[2]) for seed in range(*bounds[:2])]


def run_seeds(start: int, stop: int, tiers: bool = False) -> list:
    ranges = [(s, min(s + 50, stop), tiers) for s in range(start, stop, 50)]
    # Fresh processes (spawn), not forks of this one: inside a whole test session (after gRPC
    # servers, torch, models) forked children ran the same seeds several times slower.
    with multiprocessing.get_context("spawn").Pool(min(2, os.cpu_count() or 1)) as pool:
        return [o for part in pool.map(_run, ranges) for o in part]


def failures(outcomes: list) -> str:
    return "\n".join(f"seed {o.seed}: {o.failure}\n  replay: {o.replay()}" for o in outcomes if not o.ok)


def test_every_invariant_holds_over_thousands_of_seeds():
    outcomes = run_seeds(0, SEEDS)
    assert len(outcomes) == SEEDS
    assert not failures(outcomes), failures(outcomes)
    # The seeds do exercise the faults they are meant to
    kinds = {kind for o in outcomes for kind in o.faults}
    assert {"break_between_steps", "break_mid_step", "crash", "hang", "cancel", "adapters",
            "scheduler_drain", "drain_worker", "wrong_step", "duplicate"} <= kinds
    assert sum(o.completed for o in outcomes) > SEEDS


def test_every_invariant_holds_with_second_kv_tiers():
    """Workers with tiers of 0, 2, 8 or 64 slots (prefix caching on in about half the seeds):
    blocks saved as the pools evict them and loaded back, under every fault."""
    outcomes = run_seeds(0, TIER_SEEDS, tiers=True)
    assert not failures(outcomes), failures(outcomes)
    assert sum(o.tier_loads > 0 for o in outcomes) > TIER_SEEDS // 20   # about 1 in 9 load blocks back


@pytest.mark.slow
@pytest.mark.skipif("QOS_SIM_SLOW_SEEDS" not in os.environ,
                    reason="the long run (~10 CPU-minutes per 10,000 seeds): set QOS_SIM_SLOW_SEEDS=N; "
                           "`make test` stays within its budget without it")
def test_every_invariant_holds_over_many_more_seeds():
    outcomes = run_seeds(SEEDS, SEEDS + SLOW_SEEDS)
    assert not failures(outcomes), failures(outcomes)


def test_one_seed_replays_one_run_exactly():
    seeds = (1, 23, 87, 699)
    digests = [simulate(s).digest for s in seeds]
    assert digests == [simulate(s).digest for s in seeds]
    other_process = subprocess.run(
        [sys.executable, "-c", "from tests.sim.run import simulate; "
                               f"print(' '.join(simulate(s).digest for s in {seeds!r}))"],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert other_process.stdout.split() == digests


# --- bugs found, each with its seed: fixed, and failing again with the fix taken out -------------

def old_placer(self, workers, planner, step):
    """PrefixCache.placer before the fix: any worker holding the longest prefix, even one whose
    class cap can never hold the request."""
    def may_place(worker, request) -> bool:
        placed = request.placement
        if placed is None or placed[0] != step():
            open_workers = [w for w in workers if w.is_connected and w.pool is not None and workers.admits(w)]
            placed = request.placement = (step(), self.placement(request, open_workers, planner.running,
                                                                 planner.max_running))
        return placed[1] is None or placed[1] == worker.index
    return may_place


def skip_failover_on_close(monkeypatch):
    MUTATIONS["skip failover on a closed link"](monkeypatch.setattr)


def place_on_any_cache(monkeypatch):
    monkeypatch.setattr(PrefixCache, "placer", old_placer)


def keep_unservable_heads(monkeypatch):
    monkeypatch.setattr(WorkerChanges, "_hand_back_unservable", lambda self, now: None)


def cut_in_after_a_release(monkeypatch):
    """Cut-ins planned as before the fix: whatever sequences left the worker since its step in
    flight was planned."""
    dispatch = CutInDispatch.dispatch

    def dispatching(self):
        pending = {index: list(ids) for index, ids in self.planner.to_release.items()}
        for ids in self.planner.to_release.values():
            ids.clear()
        try:
            dispatch(self)
        finally:
            for index, ids in pending.items():
                self.planner.to_release[index][:0] = ids
    monkeypatch.setattr(CutInDispatch, "dispatch", dispatching)


REGRESSIONS = [
    # A worker's stream ends between two steps: its sequences stayed on it (stranded), and once it
    # reconnected they ran against its new pool (blocks freed into it, "sequence not known").
    pytest.param(10, ("break_between_steps",), skip_failover_on_close, id="stream-ends-between-steps"),
    pytest.param(24, ("break_between_steps",), skip_failover_on_close, id="stream-ends-between-steps-2"),
    # Prefix-cache placement pinned a request to the worker holding its prefix although that
    # worker's class cap could never hold it (mixed worker sizes): it waited there for good.
    pytest.param(985, (), place_on_any_cache, id="placement-beyond-cap"),
    pytest.param(1663, (), place_on_any_cache, id="placement-beyond-cap-2"),
    # A lane's head no worker could take (its adapter only on a worker too small for its class
    # cap) held every request behind it for good: now handed back after orphan_grace_s.
    pytest.param(699, (), keep_unservable_heads, id="unservable-lane-head"),
    pytest.param(1085, (), keep_unservable_heads, id="unservable-lane-head-2"),
    # ... a streaming one, whose window's blocks no worker holding its adapter could take.
    pytest.param(4613, (), keep_unservable_heads, id="unservable-streaming-head"),
    # A stop string ended a sequence after the plan computing it once more was sent; a High cut-in
    # into that very step was given the blocks it freed, which the step still wrote (the real
    # worker refuses such a cut-in: the High request failed, INTERNAL).
    pytest.param(6915, (), cut_in_after_a_release, id="cut-in-into-blocks-still-written"),
]


@pytest.mark.parametrize("seed, only, revert", REGRESSIONS)
def test_a_bug_the_simulator_found_stays_fixed(seed, only, revert, monkeypatch):
    outcome = simulate(seed, only)
    assert outcome.ok, f"{outcome.failure}\n  replay: {outcome.replay()}"
    revert(monkeypatch)
    assert not simulate(seed, only).ok, "the seed no longer shows the bug it was chosen for"


# --- mutations (the table in docs/operations.md) -------------------------------------------------

MUTATION_SEEDS = {
    "skip failover on a closed link": [14, 22, 23],
    "release blocks into another worker's pool": [0, 1, 2],
    "drop one token on resume": [0, 1, 2],
    "answer a cancelled request once more": [2, 8, 19],
}


@pytest.mark.parametrize("name", sorted(MUTATION_SEEDS))
def test_the_simulator_catches_a_mutation(name, monkeypatch):
    MUTATIONS[name](monkeypatch.setattr)
    outcomes = [simulate(seed) for seed in MUTATION_SEEDS[name]]
    assert [o.seed for o in outcomes if o.ok] == [], f"{name}: these seeds no longer catch it"
