"""How many Medium and Low requests the router lets into each pool at once; the rest wait in
the router, in arrival order per class, and go on as those ahead of them finish.

Why: a scheduler queues what it cannot run yet, so forwarding a flood at once buys nothing for
the flood, and costs High its first token. Each forwarded request costs a gRPC call from router
to scheduler and the scheduler's intake (~0.25 ms and ~1 ms of CPU, bench/control_plane_cpu.py),
all of it in the flood's first second, when the router's and scheduler's event loops are what a
High request waits on. With the QoS benchmark's full-scale flood (800 requests in 1 s, 2 cores)
High's P99 time to first token was 279-367 ms with everything forwarded at once and 45 ms with
64 of each class in flight (docs/performance.md). Held requests cost the router a parked
coroutine each.

What stays as it was:
- High is never held; neither is a request with an SLO (x-slo-ms): the scheduler judges that
  against its queue at once, and a held request of its class is behind it anyway.
- WFQ: each class has a window of its own, so the scheduler always sees Medium and Low backlogs
  (up to the window each) and shares steps 5:3:2 between them.
- A full queue is refused as before, here: when a class's requests in flight and held reach the
  pool's `max_queue`, RESOURCE_EXHAUSTED with the pool's retry-after.
- The router's picture of a pool's load counts its held requests (PoolDirectory adds them).
- The priority-blind FCFS baseline (router.admission = "fifo") holds nothing.

Pure asyncio, no gRPC: tests/unit/test_forward_window.py.
"""
from __future__ import annotations

import asyncio
import collections
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import priority_name


@dataclass(slots=True)
class ClassWindow:
    """One pool's window for one class: requests forwarded and not finished, and those waiting."""
    in_flight: int = 0
    waiting: collections.deque = field(default_factory=collections.deque)   # futures, arrival order


@dataclass(slots=True, frozen=True)
class PoolQueueLimit:
    """The pool's scheduler's queue limit per class, and the retry-after it gives when full."""
    max_queue: int
    retry_after_ms: int


class ForwardWindows:
    def __init__(self, size: int, limits: dict[str, PoolQueueLimit]):
        """`size`: requests of one class in flight to one pool (0: no window); `limits`: per pool."""
        self.size = size
        self.limits = limits
        self._windows: dict[tuple[str, int], ClassWindow] = collections.defaultdict(ClassWindow)

    def held(self, pool: str) -> int:
        """Requests waiting in the router for this pool, all classes."""
        return sum(len(w.waiting) for (name, _), w in self._windows.items() if name == pool)

    def counts(self, pool: str, priority: int) -> tuple[int, int]:
        """(in flight, held) for one class of one pool."""
        window = self._windows.get((pool, priority))
        return (window.in_flight, len(window.waiting)) if window else (0, 0)

    def collect(self):
        """Prometheus collector (registered in the router's registry): per pool and class, the
        requests in flight through the window and those held in the router."""
        held = GaugeMetricFamily("qos_router_held_requests", "Medium/Low requests waiting in the "
                                 "router for their class's forward window", labels=("pool", "priority"))
        in_flight = GaugeMetricFamily("qos_router_window_in_flight", "Medium/Low requests in flight "
                                      "to their pool through the forward window", labels=("pool", "priority"))
        for (pool, priority), window in sorted(list(self._windows.items())):   # a scrape thread: copy first
            held.add_metric((pool, priority_name(priority)), len(window.waiting))
            in_flight.add_metric((pool, priority_name(priority)), window.in_flight)
        yield held
        yield in_flight

    @asynccontextmanager
    async def turn(self, pool: str, priority: int, exempt: bool = False):
        """Hold until this request may go to `pool`, and count it in flight until the block ends
        (finished, failed, or its client went away). `exempt` requests pass at once, uncounted."""
        if exempt or self.size <= 0:
            yield
            return
        window = self._windows[pool, priority]
        if window.in_flight >= self.size:
            self._check_room(pool, priority, window)
            ticket = asyncio.get_running_loop().create_future()
            window.waiting.append(ticket)
            try:
                await ticket                     # resolved by _release, with the slot handed over
            except BaseException:
                if ticket.done() and not ticket.cancelled():
                    self._release(window)        # the slot was handed over as it was cancelled
                elif ticket in window.waiting:  # a release may have skipped it already
                    window.waiting.remove(ticket)
                raise
        else:
            window.in_flight += 1
        try:
            yield
        finally:
            self._release(window)

    def _check_room(self, pool: str, priority: int, window: ClassWindow) -> None:
        limit = self.limits.get(pool)
        if limit is not None and window.in_flight + len(window.waiting) >= limit.max_queue:
            raise ServiceError(
                ErrorKind.EXHAUSTED, f"the {priority_name(priority)} queue of pool {pool} is full "
                f"({limit.max_queue} waiting); retry after {limit.retry_after_ms} ms",
                retry_after_ms=limit.retry_after_ms, reason="queue_full")

    @staticmethod
    def _release(window: ClassWindow) -> None:
        """A request left: its slot goes to the next one waiting (in_flight stays), else it frees."""
        while window.waiting:
            ticket = window.waiting.popleft()
            if not ticket.done():
                ticket.set_result(None)
                return
        window.in_flight -= 1
