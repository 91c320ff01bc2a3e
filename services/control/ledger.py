"""The billing ledger's writer at the router: one row per request that ended having produced
tokens (or completed), written in batches off the request path.

Rows wait in memory and go to the store every `flush_seconds` (1 s) in one transaction, from a
helper thread; the router's drain flushes what is left before it exits. A router that is killed
loses at most the rows of requests that ended in its last batch window. The request id is the
table's key and rows are inserted with ON CONFLICT DO NOTHING, so a batch retried after an error
never writes a row twice; a request that never produced a token writes no row.
"""
from __future__ import annotations

import asyncio
import logging

from services.store.store import Store

log = logging.getLogger(__name__)

MAX_PENDING = 100_000       # rows kept while the database is unreachable, then the oldest go


class LedgerWriter:
    def __init__(self, store: Store, flush_seconds: float = 1.0):
        self.store = store
        self.flush_seconds = flush_seconds
        self.pending: list[dict] = []
        self.written = 0

    def record(self, row: dict) -> None:
        self.pending.append(row)
        if len(self.pending) > MAX_PENDING:
            dropped = len(self.pending) - MAX_PENDING
            log.error("ledger: the store has been unreachable too long; dropping %d oldest rows", dropped)
            del self.pending[:dropped]

    async def flush(self) -> None:
        rows, self.pending = self.pending, []
        if not rows:
            return
        try:
            self.written += await asyncio.to_thread(self.store.write_ledger, rows)
        except Exception as exc:        # keep them for the next try
            log.warning("ledger: writing %d rows to %s failed (%s); retrying", len(rows), self.store.url, exc)
            self.pending[:0] = rows

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_seconds)
            await self.flush()
