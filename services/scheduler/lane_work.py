"""One step's running sequences on one worker, sorted into lanes for the planner
(services/scheduler/planner.py).

Within a lane: decodes first (one token each, latency-critical), then prefill chunks; oldest
first. `ready` holds the common case, decodes whose next token fits in the blocks they hold (no
allocation, no preemption, nothing new to tell the worker): the planner takes them in slices,
without a Python loop per sequence, since a step is mostly them. `others` holds the rest: decodes
that need a new block, then sequences with prompt (or recompute) tokens left.
"""
from __future__ import annotations

import math
from collections import deque

from services.scheduler.request import Request


class LaneWork:
    __slots__ = ("ready", "others", "_taken")

    def __init__(self, running: list[Request], lanes: tuple[int, ...], lane_by_priority: dict[int, int],
                 block_size: int):
        self.ready: dict[int, list[Request]] = {lane: [] for lane in lanes}
        self.others: dict[int, deque[Request]] = {lane: deque() for lane in lanes}
        self._taken = dict.fromkeys(lanes, 0)          # ready decodes already handed out, per lane
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

    def has_running(self, lane: int) -> bool:
        return bool(self.ready[lane] or self.others[lane])

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

    def first_token_pending(self, lane: int) -> bool:
        """A running sequence of the lane still waits for its first token (prefill under way)."""
        return any(r.first_token_at is None for r in self.others[lane])
