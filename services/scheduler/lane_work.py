"""One step's running sequences on one worker, sorted into lanes for the planner
(services/scheduler/planner.py).

Within a lane: decodes first (one token each, latency-critical), then prefill chunks; oldest
first. `ready` holds the common case, decodes whose next token fits in the blocks they hold (no
allocation, no preemption, nothing new to tell the worker): the planner takes them in slices,
without a Python loop per sequence, since a step is mostly them. `others` holds the rest: decodes
that need a new block, then sequences with prompt (or recompute) tokens left. Decodes a short
step left out (`first`, step_clock.py) go first the next step: ready ones at the head of `ready`,
those that need a block in `overdue`, which the planner serves before the lane's ready decodes.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from services.scheduler.request import Phase, Request


class LaneWork:
    __slots__ = ("ready", "others", "overdue", "_taken", "_overdue_at_start")

    def __init__(self, running: list[Request], lanes: tuple[int, ...], lane_by_priority: dict[int, int],
                 block_size: int, first: dict[Request, int] | None = None):
        self.ready: dict[int, list[Request]] = {lane: [] for lane in lanes}
        self.others: dict[int, deque[Request]] = {lane: deque() for lane in lanes}
        # By lane, decodes that need a new block and that a short step left out last time: before
        # the rest (only lanes that have some: most plans have none).
        self.overdue: dict[int, deque[Request]] = {}
        self._taken = dict.fromkeys(lanes, 0)          # ready decodes already handed out, per lane
        self._overdue_at_start: list[Request] = []
        prefills = []
        for request in running:
            computed = request.computed
            if len(request.prompt_ids) + len(request.output_ids) - computed > 1:
                prefills.append(request)
            elif request.announced and computed < len(request.blocks) * block_size:
                self.ready[lane_by_priority[request.priority]].append(request)
            else:
                self.others[lane_by_priority[request.priority]].append(request)
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
            late = sorted((r for r in self.others[lane] if r in first), key=first.__getitem__)
            if late:
                self.overdue[lane] = deque(late)
                self._overdue_at_start += late
                self.others[lane] = deque(r for r in self.others[lane] if r not in first)

    def has_running(self, lane: int) -> bool:
        return bool(self.ready[lane] or self.others[lane] or self.overdue.get(lane))

    def take_ready(self, lane: int, allowance_left: float, budget: int) -> list[Request]:
        """The lane's next ready decodes: as many as the allowance left (rounded up: a lane's turn
        ends after the item that reaches it) and the budget allow; [] when none is left."""
        ready, start = self.ready[lane], self._taken[lane]
        if start >= len(ready):
            return []
        wanted = budget if allowance_left == math.inf else max(1, math.ceil(allowance_left))
        count = min(len(ready) - start, budget, wanted)
        self._taken[lane] = start + count
        return ready[start:start + count]

    def put_back(self, lane: int, count: int) -> None:
        """The last `count` decodes taken were not scheduled after all: they stay for later."""
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
        return any(r.first_token_at is None for r in self.others[lane])
