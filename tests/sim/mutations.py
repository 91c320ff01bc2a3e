"""Mutations the simulator must catch: each a small, plausible bug, applied with pytest's
monkeypatch (tests/unit/test_fault_sim.py) or `apply(name)` (python -m tests.sim.mutations), so
that the table of which seeds catch which in docs/operations.md stays true."""
from __future__ import annotations

import contextlib
import sys

from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.failover import WorkerChanges
from services.scheduler.planner import StepPlanner
from services.scheduler.request import Phase


def skip_failover_on_close(patch) -> None:
    """A link that closes between steps does not tell the batcher (the bug before the fix)."""
    patch(WorkerChanges, "link_closed", lambda self, link, reason: None)


def release_into_current_pool(patch) -> None:
    """Blocks are freed into whatever pool the worker has now, as before the fix (with the
    failover on close in place, no sequence outlives its pool: see release_into_other_pool)."""
    original = StepPlanner.release

    def release(self, worker, request):
        if request.blocks and worker.pool is not None and request.pool is not worker.pool:
            worker.pool.free(request.priority, request.blocks)
            request.blocks = []
        original(self, worker, request)
    patch(StepPlanner, "release", release)


def release_into_other_pool(patch) -> None:
    """Blocks are freed into another worker's pool, when the pool has another worker."""
    watch, release = WorkerChanges.watch, StepPlanner.release

    def watching(self, link):
        watch(self, link)
        self.planner.__dict__.setdefault("mutation_links", {})[link.index] = link

    def releasing(self, worker, request):
        links = self.__dict__.get("mutation_links", {})
        other = next((l for i, l in sorted(links.items()) if i != worker.index and l.pool is not None), None)
        if request.blocks and other is not None:
            try:
                other.pool.free(request.priority, request.blocks)
            except ValueError:
                pass            # not held there: they simply never go back to their own pool
            request.blocks = []
        release(self, worker, request)
    patch(WorkerChanges, "watch", watching)
    patch(StepPlanner, "release", releasing)


def drop_token_on_resume(patch) -> None:
    """A sequence moved off a failed worker resumes without its last output token (recomputed
    from one token earlier, its stream repeats that token)."""
    original = WorkerChanges.fail_worker

    def fail_worker(self, link, reason, why="worker_failed"):
        moved = list(self.running.get(link.index, ()))
        original(self, link, reason, why)
        for request in moved:
            if request.phase is Phase.WAITING and request.output_ids:
                request.set_output(request.output_ids[:-1])
    patch(WorkerChanges, "fail_worker", fail_worker)


def answer_cancelled_once_more(patch) -> None:
    """A cancel frees the sequence at the next step but does not mark the request cancelled:
    the token of the step in flight still goes to the client that went away."""
    def cancel(self, request):
        self.streams.forget(request)
        if request.phase is not Phase.FINISHED:
            self.cancelled.add(request)
            self.wakeup.set()
    patch(ContinuousBatcher, "cancel", cancel)


MUTATIONS = {
    "skip failover on a closed link": skip_failover_on_close,
    "release blocks into the pool of now": release_into_current_pool,
    "release blocks into another worker's pool": release_into_other_pool,
    "drop one token on resume": drop_token_on_resume,
    "answer a cancelled request once more": answer_cancelled_once_more,
}


@contextlib.contextmanager
def applied(*names: str):
    """Apply mutations for the length of the block (outside pytest)."""
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)
    try:
        for name in names:
            MUTATIONS[name](patch)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


if __name__ == "__main__":
    from tests.sim.run import simulate
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    for name in MUTATIONS:
        with applied(name):
            caught = [s for s in range(count) if not simulate(s).ok]
        print(f"{name}: {len(caught)} of {count} seeds fail, first {caught[:8]}", flush=True)
