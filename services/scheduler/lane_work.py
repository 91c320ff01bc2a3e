"""One step's running sequences on one worker, sorted into lanes for the planner
(services/scheduler/planner.py).

Within a lane: decodes first (one token each, latency-critical), then prefill chunks; oldest
first. `ready` holds the common case, decodes whose next token fits in the blocks they hold (no
allocation, no preemption, nothing new to tell the worker); `boundary` the decodes whose next
token starts a new block (with 16-token blocks, about one decode in 16 each step). The planner
takes both in slices, ready ones first, without a Python loop per sequence: a step is mostly
them. `others` holds the rest: sequences with prompt (or recompute) tokens left, and any decode
the worker has not been told of yet.
"""
from __future__ import annotations

import math
from collections import deque

from services.scheduler.request import Request


class LaneWork:
    __slots__ = ("ready", "boundary", "others", "_taken", "_boundary_taken")

    def __init__(self, running: list[Request], lanes: tuple[int, ...], lane_by_priority: dict[int, int]):
        self.ready: dict[int, list[Request]] = {lane: [] for lane in lanes}
        self.boundary: dict[int, list[Request]] = {lane: [] for lane in lanes}
        self.others: dict[int, deque[Request]] = {lane: deque() for lane in lanes}
        self._taken = dict.fromkeys(lanes, 0)          # ready decodes already handed out, per lane
        self._boundary_taken = dict.fromkeys(lanes, 0)  # ... and boundary ones
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

    def has_running(self, lane: int) -> bool:
        return bool(self.ready[lane] or self.boundary[lane] or self.others[lane])

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

    def first_token_pending(self, lane: int) -> bool:
        """A running sequence of the lane still waits for its first token (prefill under way)."""
        return any(r.first_token_at is None for r in self.others[lane]) or \
            any(r.first_token_at is None for r in self.boundary[lane])
