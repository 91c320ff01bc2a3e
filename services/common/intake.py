"""Admission of new requests, one at a time, highest priority first (router and scheduler).

Why this exists: grpc.aio's server takes in one new call per event-loop turn, in arrival order,
and a burst makes every turn long: each accepted call's handler does its work (the scheduler
tokenizes the prompt, the router validates and forwards it) in the same turns. A High request that
arrived behind a burst of hundreds of long Low prompts waited for all of them to be accepted and
handled first (measured in bench/qos_burst.py: 300-860 ms between the router forwarding a High
request and the scheduler's handler starting on it).

Here a handler does only the cheapest part itself and enqueues the rest (microseconds); one task
admits queued requests in (priority, arrival) order and, while a backlog remains, pauses `pause_s`
after each, so the event loop spends the burst taking in calls and a new High one goes to the front.
A High request then waits for at most one admission in progress. With `by_priority=False` requests
are admitted in arrival order: the priority-blind FCFS baseline.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Awaitable, Callable, Generic, TypeVar

Submit = TypeVar("Submit")
Admitted = TypeVar("Admitted")

# Long enough for the event loop to take in several pending calls (each costs ~0.1-0.3 ms here),
# short enough that admitting a backlog of 1,000 requests costs about a second, spread over it.
ADMISSION_PAUSE_S = 0.001


class PriorityIntake(Generic[Submit, Admitted]):
    def __init__(self, admit: Callable[[Submit], Awaitable[Admitted]], by_priority: bool = True,
                 pause_s: float = ADMISSION_PAUSE_S):
        self._pause_s = pause_s
        self._admit = admit                      # may raise; the exception reaches the caller
        self._by_priority = by_priority
        self._heap: list[tuple[int, int, Submit, asyncio.Future]] = []
        self._arrivals = itertools.count()
        self._pending = asyncio.Event()

    def __len__(self) -> int:
        """Requests waiting to be admitted."""
        return len(self._heap)

    async def admit(self, submit: Submit, priority: int) -> Admitted:
        """Wait for this request's turn and admit it (lower `priority` numbers go first)."""
        future = asyncio.get_running_loop().create_future()
        rank = priority if self._by_priority else 0
        heapq.heappush(self._heap, (rank, next(self._arrivals), submit, future))
        self._pending.set()
        # If the caller is cancelled while waiting, the future is cancelled with it and skipped.
        return await future

    async def run(self) -> None:
        """Admit queued requests until cancelled."""
        while True:
            await self._pending.wait()
            self._pending.clear()
            while self._heap:
                _, _, submit, future = heapq.heappop(self._heap)
                if future.done():            # its client went away while it waited
                    continue
                try:
                    admitted = await self._admit(submit)
                except Exception as exc:     # a refusal (or a bug) goes to that request alone
                    if not future.done():
                        future.set_exception(exc)
                else:
                    if not future.done():
                        future.set_result(admitted)
                if self._heap:
                    # Let the server take in new calls (a High one goes to the front) and stream.
                    await asyncio.sleep(self._pause_s)
