"""One step's running sequences on one worker, sorted into lanes for the planner
(services/scheduler/planner.py).

Within a lane: decodes first (one token each, latency-critical), then prefill chunks; oldest
first. `ready` holds the common case, decodes whose next token fits in the blocks they hold (no
allocation, no preemption, nothing new to tell the worker); `boundary` the decodes whose next
token starts a new block (with 16-token blocks, about one decode in 16 each step). The planner
takes both in slices, ready ones first, without a Python loop per sequence: a step is mostly
them. `others` holds the rest: sequences with prompt (or recompute) tokens left, and any decode
the worker has not been told of yet. Decodes a short step left out (`first`, step_clock.py) go
first the next step: ready ones at the head of `ready`, boundary ones in `overdue`, which the
planner serves before the lane's ready decodes.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from services.scheduler.request import Phase, Request


class LaneWork:
    __slots__ = ("ready", "boundary", "others", "overdue", "_taken", "_boundary_taken", "_overdue_at_start")

    def __init__(self, running: list[Request], lanes: tuple[int, ...], lane_by_priority: dict[int, int],
                 first: dict[Request, int] | None = None):
        self.ready: dict[int, list[Request]] = {lane: [] for lane in lanes}
        self.boundary: dict[int, list[Request]] = {lane: [] for lane in lanes}
        self.others: dict[int, deque[Request]] = {lane: deque() for lane in lanes}
        # By lane, decodes that need a new block and that a short step left out last time: before
        # the rest (only lanes that have some: most plans have none).
        self.overdue: dict[int, deque[Request]] = {}
        self._taken = dict.fromkeys(lanes, 0)          # ready decodes already handed out, per lane
        self._boundary_taken = dict.fromkeys(lanes, 0)  # ... and boundary ones
        self._overdue_at_start: list[Request] = []
        prefills = []
        for request in running:
            # pending and room, not computed against num_tokens and capacity: small ints for a
            # decode, no int object to fetch per sequence (request.py)
            if request.pending > 1:
                prefills.append(request)
            elif not request.announced:
                self.others[lane_by_priority[request.priority]].append(request)
            elif request.room > 0:
                self.ready[lane_by_priority[request.priority]].append(request)
            else:
                self.boundary[lane_by_priority[request.priority]].append(request)
        for request in prefills:
            self.others[lane_by_priority[request.priority]].append(request)
        if first:
            self._put_first(first)

    def _put_first(self, first: dict[Request, int]) -> None:
        """Decodes a short step left out last time (step_clock.py) go first now, in the order they
        waited in (`first`: their rank), so that every sequence's turn comes."""
        last = len(first)
        for lane, ready in self.ready.items():
            ready.sort(key=lambda r: first.get(r, last))
            late = sorted((r for r in self.boundary[lane] + list(self.others[lane]) if r in first),
                          key=first.__getitem__)
            if late:
                self.overdue[lane] = deque(late)
                self._overdue_at_start += late
                self.boundary[lane] = [r for r in self.boundary[lane] if r not in first]
                self.others[lane] = deque(r for r in self.others[lane] if r not in first)

    def has_running(self, lane: int) -> bool:
        return bool(self.ready[lane] or self.boundary[lane] or self.others[lane] or self.overdue.get(lane))

    def take_ready(self, lane: int, allowance_left: float, budget: int) -> tuple[list[Request], bool]:
        """The lane's next decodes: ready ones, then boundary ones, never both in one slice (the
        flag says it is boundary ones: each needs a block); as many as the allowance left (rounded
        up: a lane's turn ends after the item that reaches it) and the budget allow; ([], False)
        when none is left."""
        wanted = budget if allowance_left == math.inf else max(1, math.ceil(allowance_left))
        ready, start = self.ready[lane], self._taken[lane]
        if start < len(ready):
            count = min(len(ready) - start, budget, wanted)
            self._taken[lane] = start + count
            return ready[start:start + count], False
        boundary, start = self.boundary[lane], self._boundary_taken[lane]
        if start < len(boundary):
            count = min(len(boundary) - start, budget, wanted)
            self._boundary_taken[lane] = start + count
            return boundary[start:start + count], True
        return [], False

    def put_back(self, lane: int, count: int, boundary: bool) -> None:
        """The last `count` decodes taken (of the kind `boundary` says) were not scheduled after
        all: they stay for later."""
        if boundary:
            self._boundary_taken[lane] -= count
        else:
            self._taken[lane] -= count

    def left_out(self, running: list[Request], scheduled: Callable[[Request], bool]) -> dict[Request, int]:
        """Decodes not scheduled this step, each with its rank: those overdue already, then the
        ready ones in their order, then the rest of the worker's `running` ones (those that needed
        a block) in theirs."""
        candidates = self._overdue_at_start + [r for ready in self.ready.values() for r in ready] + running
        waiting = [r for r in candidates if r.phase is Phase.RUNNING and r.pending == 1 and not scheduled(r)]
        return {r: i for i, r in enumerate(dict.fromkeys(waiting))}

    def first_token_pending(self, lane: int) -> bool:
        """A running sequence of the lane still waits for its first token (prefill under way)."""
        return any(r.first_token_at is None for r in self.others[lane]) or \
            any(r.first_token_at is None for r in self.boundary[lane])
