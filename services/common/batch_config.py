"""The `[batches]` table: how routers run OpenAI's Batch API (services/router/openai_api/batch_runner.py)."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.priority import LABELS
from services.common.settings import POSITIVE, Bounds, setting


@dataclass(slots=True)
class BatchConfig:
    """OpenAI's Batch API: uploaded JSONL files of requests, run by the routers in the background."""
    priority: str = setting("low", "the class every batch line runs in", choices=LABELS)
    concurrency: int = setting(8, "lines of one batch in flight at once on a router", bounds=Bounds(1, 1024))
    max_file_bytes: int = setting(64 * 2**20, "the largest file POST /v1/files takes (413 above)",
                                  bounds=Bounds(1024))
    max_lines: int = setting(50_000, "the most requests one batch may hold (OpenAI's bound)", bounds=Bounds(1))
    lease_s: float = setting(30.0, "a router running a batch renews its claim this often x 3; a batch whose "
                             "router stopped is taken over once its claim is this old", bounds=POSITIVE)
