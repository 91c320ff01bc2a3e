"""The worker as planning sees it (planner.py, room.py): a few fields, not the gRPC link."""
from __future__ import annotations

from typing import Protocol

from services.common.kv_blocks import KVBlockPool


class Worker(Protocol):
    """What planning needs of a worker link (services/scheduler/worker_link.py, or a test double)."""
    index: int
    pool: KVBlockPool | None
    adapters: frozenset[str]          # LoRA adapters it holds
    max_loras: int                    # distinct adapters its running sequences may use
