"""Admission of new requests, one at a time, highest priority first (router and scheduler).

Why this exists: grpc.aio's server takes in one new call per event-loop turn, in arrival order,
and a burst makes every turn long: each accepted call's handler does its work (the scheduler
tokenizes the prompt, the router validates and forwards it) in the same turns. A High request that
arrived behind a burst of hundreds of long Low prompts waited for all of them to be accepted and
handled first (measured in bench/qos_burst.py: 300-860 ms between the router forwarding a High
request and the scheduler's handler starting on it).

Here a handler does only the cheapest part itself and enqueues the rest (microseconds); one task
starts admissions in (priority, arrival) order and, while a backlog remains, pauses `pause_s`
after each, so the event loop spends the burst taking in calls and a new High one goes to the front.
A class has one admission in progress at a time, and a lower class's does not hold a higher one
back: a High request waits for no Low or Medium admission (tokenizing a long prompt), at most for
one High one. With `by_priority=False` requests are admitted one at a time in arrival order: the
priority-blind FCFS baseline.

The top class (`express_rank`, High) skips the queue when none of its requests waits or is being
admitted: its handler admits it at once. It would be next anyway; through the queue it also waited
for the admitting task's turns of the event loop (three, each as long as a burst makes a turn),
and while a flood is taken in those are what its first token waits for.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from typing import Awaitable, Callable, Generic, TypeVar

Submit = TypeVar("Submit")
Admitted = TypeVar("Admitted")

# Long enough for the event loop to take in several pending calls (each costs ~0.1-0.3 ms here),
# short enough that admitting a backlog of 1,000 requests costs about a second, spread over it.
ADMISSION_PAUSE_S = 0.001


class PriorityIntake(Generic[Submit, Admitted]):
    def __init__(self, admit: Callable[[Submit], Awaitable[Admitted]], by_priority: bool = True,
                 pause_s: float = ADMISSION_PAUSE_S, express_rank: int | None = None):
        self._pause_s = pause_s
        # Admitted in its own handler when none of its class waits or is being admitted (the
        # highest class: it would be next anyway); never in the priority-blind FCFS baseline.
        self._express_rank = express_rank if by_priority else None
        self._admit = admit                      # may raise; the exception reaches the caller
        self._by_priority = by_priority
        self._heap: list[tuple[int, int, Submit, asyncio.Future]] = []
        self._arrivals = itertools.count()
        self._pending = asyncio.Event()
        self._busy: set[int] = set()             # classes (ranks) with an admission in progress
        self._queued: Counter[int] = Counter()   # requests in the heap, per class (rank)

    def __len__(self) -> int:
        """Requests waiting to be admitted."""
        return len(self._heap)

    async def admit(self, submit: Submit, priority: int) -> Admitted:
        """Wait for this request's turn and admit it (lower `priority` numbers go first)."""
        rank = priority if self._by_priority else 0
        if rank == self._express_rank and rank not in self._busy and not self._queued[rank]:
            self._busy.add(rank)
            try:
                return await self._admit(submit)
            finally:
                self._admission_over(rank)
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (rank, next(self._arrivals), submit, future))
        self._queued[rank] += 1
        self._pending.set()
        # If the caller is cancelled while waiting, the future is cancelled with it and skipped.
        return await future

    async def run(self) -> None:
        """Admit queued requests until cancelled: the best waiting one next, as soon as no other
        request of its class is being admitted. A lower class's admission in progress does not
        hold a higher one back (the scheduler's tokenizing of a 4,000-token prompt takes ~10 ms:
        a High request that arrived meanwhile waited for it); within a class one at a time, in
        arrival order. The FCFS baseline is one class: one at a time, in arrival order."""
        admitting: set[asyncio.Task] = set()
        try:
            while True:
                await self._pending.wait()
                self._pending.clear()
                while self._heap and self._heap[0][0] not in self._busy:
                    rank, _, submit, future = heapq.heappop(self._heap)
                    self._queued[rank] -= 1
                    if future.done():            # its client went away while it waited
                        continue
                    self._busy.add(rank)
                    task = asyncio.ensure_future(self._admit_one(rank, submit, future))
                    admitting.add(task)
                    task.add_done_callback(admitting.discard)
                    if self._heap:
                        # Let the server take in new calls (a High one goes to the front) and stream.
                        await asyncio.sleep(self._pause_s)
        finally:
            for task in admitting:
                task.cancel()

    async def _admit_one(self, rank: int, submit: Submit, future: asyncio.Future) -> None:
        try:
            admitted = await self._admit(submit)
        except asyncio.CancelledError:   # the intake stops (server shutdown): its caller too
            future.cancel()
            raise
        except Exception as exc:     # a refusal (or a bug) goes to that request alone
            if not future.done():
                future.set_exception(exc)
        else:
            if not future.done():
                future.set_result(admitted)
        finally:
            self._admission_over(rank)

    def _admission_over(self, rank: int) -> None:
        """An admission of class `rank` ended (either way): the next of its class may go."""
        self._busy.discard(rank)
        self._pending.set()
