"""How many Medium and Low requests the router lets into each pool at once; the rest wait in
the router and go on as those ahead of them finish: tenants by turns, by weight (fair queueing
over forwards, as the scheduler shares a class between tenants), each tenant's in arrival order.

Why: a scheduler queues what it cannot run yet, so forwarding a flood at once buys nothing for
the flood, and costs High its first token. Each forwarded request costs a gRPC call from router
to scheduler and the scheduler's intake (~0.25 ms and ~1 ms of CPU, bench/control_plane_cpu.py),
all of it in the flood's first second, when the router's and scheduler's event loops are what a
High request waits on. With the QoS benchmark's full-scale flood (800 requests in 1 s, 2 cores)
High's P99 time to first token was 279-367 ms in runs with everything forwarded at once and
45-81 ms in the first runs with 64 of each class in flight (docs/performance.md). Held requests cost the router a parked
coroutine each.

Off by default (`router.forward_window = 0`): the comparison above was across runs; in two
alternating pairs on the final code (window / none: 61.5 / 46.9 ms, 174.5 / 155.7 ms) it did not
lower High's tail, so the effect is not established.

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
import itertools
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily

from services.common.priority import priority_name
from services.common.queue_limit import check_queue  # the same rule and message as the scheduler's


@dataclass(slots=True)
class Held:
    """A request waiting in the router for its turn."""
    arrival: int
    weight: float                     # its tenant's weight inside the class
    ticket: asyncio.Future            # resolved when a slot is handed to it


@dataclass(slots=True)
class ClassWindow:
    """One pool's window for one class: requests forwarded and not finished, those waiting (per
    tenant, in arrival order), and the tenants' places in a fair queue of forwards."""
    in_flight: int = 0
    waiting: dict[str, collections.deque] = field(default_factory=dict)
    held: int = 0
    # Weighted fair queueing over forwards: each forward moves its tenant's tag on by 1 / weight;
    # a tenant that was away starts at the clock (the last forward's start), so idleness earns no credit.
    finish: dict[str, float] = field(default_factory=dict)
    clock: float = 0.0

    def charge(self, tenant: str, weight: float) -> None:
        """A request of `tenant` goes on to the scheduler."""
        start = max(self.finish.get(tenant, 0.0), self.clock)
        self.clock = start
        self.finish[tenant] = start + 1.0 / weight
        for other in [t for t, tag in self.finish.items() if tag <= self.clock and t not in self.waiting]:
            del self.finish[other]               # caught up and not waiting: nothing to remember

    def next_tenant(self) -> str | None:
        """The tenant whose oldest waiting request goes next: the smallest tag after this forward
        (the scheduler shares a class between tenants by weight; a tenant's flood must not hold
        another's request back in the router), then the earliest arrival."""
        best, best_key = None, None
        for tenant, queue in list(self.waiting.items()):
            while queue and queue[0].ticket.done():      # its client went away
                queue.popleft()
            if not queue:
                del self.waiting[tenant]
                continue
            key = (max(self.finish.get(tenant, 0.0), self.clock) + 1.0 / queue[0].weight, queue[0].arrival)
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        return best


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
        self._arrivals = itertools.count()

    def held(self, pool: str) -> int:
        """Requests waiting in the router for this pool, all classes."""
        return sum(w.held for (name, _), w in self._windows.items() if name == pool)

    def counts(self, pool: str, priority: int) -> tuple[int, int]:
        """(in flight, held) for one class of one pool."""
        window = self._windows.get((pool, priority))
        return (window.in_flight, window.held) if window else (0, 0)

    def collect(self):
        """Prometheus collector (registered in the router's registry): per pool and class, the
        requests in flight through the window and those held in the router."""
        held = GaugeMetricFamily("qos_router_held_requests", "Medium/Low requests waiting in the "
                                 "router for their class's forward window", labels=("pool", "priority"))
        in_flight = GaugeMetricFamily("qos_router_window_in_flight", "Medium/Low requests in flight "
                                      "to their pool through the forward window", labels=("pool", "priority"))
        for (pool, priority), window in sorted(list(self._windows.items())):   # a scrape thread: copy first
            held.add_metric((pool, priority_name(priority)), window.held)
            in_flight.add_metric((pool, priority_name(priority)), window.in_flight)
        yield held
        yield in_flight

    @asynccontextmanager
    async def turn(self, pool: str, priority: int, exempt: bool = False, tenant: str = "", weight: float = 1.0):
        """Hold until this request may go to `pool`, and count it in flight until the block ends
        (finished, failed, or its client went away). `exempt` requests pass at once, uncounted.
        Among those waiting, tenants take turns by weight (ClassWindow.next_tenant)."""
        if exempt or self.size <= 0:
            yield
            return
        weight = weight if weight > 0 else 1.0
        window = self._windows[pool, priority]
        if window.in_flight >= self.size:
            self._check_room(pool, priority, window)
            held = Held(next(self._arrivals), weight, asyncio.get_running_loop().create_future())
            window.waiting.setdefault(tenant, collections.deque()).append(held)
            window.held += 1
            try:
                await held.ticket                # resolved by _release, with the slot handed over
            except BaseException:
                if held.ticket.done() and not held.ticket.cancelled():
                    self._release(window)        # the slot was handed over as it was cancelled
                else:
                    window.held -= 1             # still queued: next_tenant drops it
                raise
        else:
            window.in_flight += 1
            window.charge(tenant, weight)
        try:
            yield
        finally:
            self._release(window)

    def _check_room(self, pool: str, priority: int, window: ClassWindow) -> None:
        """The scheduler's own queue rule (services/common/queue_limit.py), over those in flight and held."""
        limit = self.limits.get(pool)
        if limit is not None:
            check_queue(priority, window.in_flight + window.held, limit.max_queue, limit.retry_after_ms, pool)

    @staticmethod
    def _release(window: ClassWindow) -> None:
        """A request left: its slot goes to the next one waiting (in_flight stays), else it frees."""
        following = window.next_tenant()
        if following is None:
            window.in_flight -= 1
            return
        queue = window.waiting[following]
        held = queue.popleft()
        if not queue:
            del window.waiting[following]
        window.held -= 1
        window.charge(following, held.weight)
        held.ticket.set_result(None)
