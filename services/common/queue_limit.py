"""The one rule for a full queue, shared by the scheduler's admission and the router's forward
window, so that both refuse with the same status and message."""
from __future__ import annotations

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import priority_name


def check_queue(priority: int, waiting: int, max_queue: int, retry_after_ms: int, pool: str) -> None:
    if waiting >= max_queue:
        raise ServiceError(
            ErrorKind.EXHAUSTED, f"the {priority_name(priority)} queue of pool {pool} is full "
            f"({max_queue} waiting); retry after {retry_after_ms} ms",
            retry_after_ms=retry_after_ms, reason="queue_full")
