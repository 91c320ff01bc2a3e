"""The pool's workers as the batching loop sees them at run time: which links exist (they come and
go: configured, registered, found by DNS), which are connected, which drain, when each last
answered, and since when the pool has had no worker to serve with. Pure Python."""
from __future__ import annotations

import asyncio
import logging
from typing import Iterator, Protocol

from services.common.kv_blocks import KVBlockPool
from services.common.proto.qos.v1 import worker_pb2

log = logging.getLogger(__name__)

# An idle worker gets an empty plan this often: its answer shows it is alive and whether it drains.
HEARTBEAT_SECONDS = 0.5


class WorkerGone(ConnectionError):
    """The worker cannot be reached, or its stream broke (raised by a link's execute)."""


class Worker(Protocol):
    """A worker as the batcher drives it: services/scheduler/worker_link.py, or a test double."""
    index: int
    address: str
    info: worker_pb2.WorkerInfo | None
    pool: KVBlockPool | None

    @property
    def is_connected(self) -> bool: ...

    async def execute(self, plan: worker_pb2.StepPlan, sent: asyncio.Future | None = None) -> worker_pb2.StepResult:
        """Run the plan; set `sent` once the plan is on its way (it may be set at once)."""

    async def close(self) -> None: ...

    def hold_off(self, seconds: float) -> None:
        """Do not reconnect for `seconds` (a worker taken out of the pool)."""


class WorkerSet:
    def __init__(self, links: list[Worker]):
        self._links: dict[int, Worker] = {link.index: link for link in links}
        self.draining: set[int] = set()          # said so in their last answer
        self.last_answer: dict[int, float] = {}   # index -> when it last answered
        self._orphaned_since: float | None = None

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._links.values()))

    def __len__(self) -> int:
        return len(self._links)

    def __getitem__(self, index: int) -> Worker:
        return self._links[index]

    def add(self, link: Worker) -> None:
        self._links[link.index] = link

    def remove(self, link: Worker) -> None:
        self._links.pop(link.index, None)
        self.forget(link)

    def forget(self, link: Worker) -> None:
        """The link failed or left: what it said no longer holds."""
        self.draining.discard(link.index)
        self.last_answer.pop(link.index, None)

    def admits(self, link: Worker) -> bool:
        """New sequences may be placed on it: connected, and not draining."""
        return link.is_connected and link.index not in self.draining

    def heartbeat_due(self, link: Worker, now: float) -> bool:
        return now - self.last_answer.get(link.index, 0.0) > HEARTBEAT_SECONDS

    def answered(self, link: Worker, draining: bool, now: float) -> None:
        self.last_answer[link.index] = now
        if draining and link.index not in self.draining:
            log.info("worker %s drains: it gets no new sequence", link.address)
            self.draining.add(link.index)
        elif not draining:
            self.draining.discard(link.index)

    def orphaned_for(self, now: float) -> float:
        """Seconds since the pool last had a worker that takes new sequences (0: it has one)."""
        if any(self.admits(link) for link in self._links.values()):
            self._orphaned_since = None
            return 0.0
        if self._orphaned_since is None:
            self._orphaned_since = now
        return now - self._orphaned_since
