"""Real-time (High) requests waiting for their first token, for a service's intake to yield to.

Why: while a flood is taken in, the router's and the scheduler's intake of Medium and Low
requests (validation, routing, the forward to the pool, tokenizing, admission checks: ~1.5 ms of
CPU a request between them, bench/control_plane_cpu.py) shares the machine's cores with the
worker computing a High request's first token. On a small host that intake is what the engine
thread waits for on the kernel's run queue (issue 20's record, docs/performance.md). A Medium or
Low request gains nothing from being admitted a few milliseconds earlier; a High one loses its
first token's time. So while a High request waits for its first token, the intake admits no lower
class (services/common/intake.py asks `holding()` before each admission) and the CPU goes to it.

Bounded: a hold lasts at most `max_hold_s` from the moment the first High request began waiting;
if High requests keep overlapping past that, lower classes are admitted as usual until no High
request waits (so steady High traffic cannot starve the others' intake). `max_hold_s` 0 turns it
off. Pure asyncio (the loop's clock); one per service process.
"""
from __future__ import annotations

import asyncio

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class FirstTokenWatch:
    def __init__(self, max_hold_s: float):
        self.max_hold_s = max_hold_s
        self.waiting = 0                   # High requests between arrival and first token (or end)
        self._since: float | None = None   # when `waiting` last went from 0 to 1 (loop time)
        self._clear = asyncio.Event()
        self._clear.set()
        self.holds = 0                     # admissions held, and for how long in all (seconds)
        self.held_s = 0.0

    def waiter(self) -> "FirstTokenWaiter":
        """Count a High request as waiting until its waiter's done() (idempotent; call it at the
        first token and again when the request ends, whichever way)."""
        if self.waiting == 0:
            self._since = asyncio.get_running_loop().time()
            self._clear.clear()
        self.waiting += 1
        return FirstTokenWaiter(self)

    def _done(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self._since = None
            self._clear.set()

    def holding(self) -> bool:
        """A High request waits for its first token and the hold has not run out."""
        return self.waiting > 0 and self.max_hold_s > 0 and \
            asyncio.get_running_loop().time() < self._since + self.max_hold_s

    def metrics(self):
        """For a StateCollector (services/common/metrics.py), at scrape time."""
        yield GaugeMetricFamily("qos_first_token_waiting", "High requests waiting for their first token here",
                                value=self.waiting)
        yield CounterMetricFamily("qos_first_token_holds", "Medium and Low admissions held while a High "
                                  "request waited for its first token", value=self.holds)
        yield CounterMetricFamily("qos_first_token_held_seconds", "Time those admissions were held, in all",
                                  value=self.held_s)

    async def hold(self, interrupt: asyncio.Event | None = None) -> None:
        """Wait until no High request waits for its first token, the hold runs out, or
        `interrupt` is set (the intake: a High request was queued meanwhile)."""
        if not self.holding():
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        waits = [asyncio.ensure_future(self._clear.wait())]
        if interrupt is not None:
            waits.append(asyncio.ensure_future(interrupt.wait()))
        try:
            await asyncio.wait(waits, timeout=self._since + self.max_hold_s - started,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        self.holds += 1
        self.held_s += loop.time() - started


class FirstTokenWaiter:
    __slots__ = ("_watch",)

    def __init__(self, watch: FirstTokenWatch):
        self._watch: FirstTokenWatch | None = watch

    def done(self) -> None:
        if self._watch is not None:
            self._watch._done()
            self._watch = None
