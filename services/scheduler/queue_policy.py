"""Waiting-queue policies behind one small interface, made by name with a factory.

The batcher asks the queue which request to admit next; a new policy is a new class here.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from services.scheduler.request import Request


class RequestQueue(ABC):
    name: str

    @abstractmethod
    def add(self, request: Request) -> None:
        """A new arrival."""

    @abstractmethod
    def add_front(self, request: Request) -> None:
        """A preempted request: it goes first among its peers."""

    @abstractmethod
    def peek(self) -> Request | None:
        """The request to admit next, left in the queue."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Take out a specific request (admitted, cancelled)."""

    @abstractmethod
    def waiting(self, priority: int) -> int:
        """How many requests of `priority` wait."""

    @abstractmethod
    def __len__(self) -> int: ...


class FCFSQueue(RequestQueue):
    """First come, first served: one queue, priorities ignored (the benchmark's baseline)."""
    name = "fcfs"

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def waiting(self, priority: int) -> int:
        return sum(1 for r in self._queue if r.priority == priority)

    def __len__(self) -> int:
        return len(self._queue)


POLICIES: dict[str, type[RequestQueue]] = {FCFSQueue.name: FCFSQueue}


def create_request_queue(policy: str) -> RequestQueue:
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {policy!r}; known: {', '.join(POLICIES)}") from None
