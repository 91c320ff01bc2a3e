"""The billing ledger's writer at the router: one row per request that ended having produced
tokens (or completed).

A request that completes has its row committed to the store before its final chunk goes to the
client (commit()): a client that saw its request complete has been billed, even if the router is
killed the next moment. The rows of requests finishing at the same time share one transaction
(group commit: while one is written, the next batch gathers), so the wait is about one store
commit, only on the last chunk, never on the first token. Should the store not answer within
COMMIT_WAIT_S, the chunk goes anyway (a client is never held hostage by the database) and the
row stays queued, retried until written: `unconfirmed` counts those.

Rows of requests that end otherwise (failed or cancelled after some tokens) are recorded without
waiting and written with the next batch, every `flush_seconds` (1 s); a router killed meanwhile
loses those. The router's drain flushes what is left before it exits. The request id is the
table's key and rows are inserted with ON CONFLICT DO NOTHING, so a batch retried after an error,
or a request retried under the same id, never writes a row twice; a request that never produced
a token writes no row.
"""
from __future__ import annotations

import asyncio
import logging

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.store.store import Store

log = logging.getLogger(__name__)

MAX_PENDING = 100_000       # rows kept while the database is unreachable, then the oldest go
COMMIT_WAIT_S = 2.0         # the longest a final chunk waits for its row to be committed
RETRY_S = 0.5               # after a failed write


class LedgerWriter:
    def __init__(self, store: Store, flush_seconds: float = 1.0):
        self.store = store
        self.flush_seconds = flush_seconds
        self.pending: list[dict] = []
        self.waiting: list[asyncio.Future] = []     # commit() callers whose rows are in `pending`
        self.written = 0
        self.unconfirmed = 0                        # final chunks sent before their row was committed
        self._due = asyncio.Event()
        self._lock = asyncio.Lock()                 # one write at a time; the next batch gathers

    def record(self, row: dict) -> None:
        """A row written with the next batch (at most flush_seconds from now)."""
        self.pending.append(row)
        if len(self.pending) > MAX_PENDING:
            dropped = len(self.pending) - MAX_PENDING
            log.error("ledger: the store has been unreachable too long; dropping %d oldest rows", dropped)
            del self.pending[:dropped]

    async def commit(self, row: dict) -> bool:
        """The row written now (with whatever else is pending); False if the store did not
        confirm it within COMMIT_WAIT_S (it stays queued)."""
        done = asyncio.get_running_loop().create_future()
        self.record(row)
        self.waiting.append(done)
        self._due.set()
        try:
            await asyncio.wait_for(asyncio.shield(done), COMMIT_WAIT_S)
            return True
        except asyncio.TimeoutError:
            self.unconfirmed += 1
            log.error("ledger: request %s's row not confirmed by %s within %.0f s; its final chunk goes "
                      "now, the row stays queued", row["request_id"], self.store.url, COMMIT_WAIT_S)
            return False

    async def flush(self) -> bool:
        """Write everything pending in one transaction; True when it was written (or nothing was
        pending). On failure the rows stay for the next try."""
        async with self._lock:
            rows, self.pending = self.pending, []
            waiting, self.waiting = self.waiting, []
            if not rows:
                return True
            try:
                self.written += await asyncio.to_thread(self.store.write_ledger, rows)
            except Exception as exc:        # keep them for the next try
                log.warning("ledger: writing %d rows to %s failed (%s); retrying", len(rows), self.store.url, exc)
                self.pending[:0] = rows
                self.waiting[:0] = waiting
                return False
        for done in waiting:
            if not done.done():
                done.set_result(None)
        return True

    async def run(self) -> None:
        """Write when a commit() asks, and every flush_seconds anyway."""
        while True:
            try:
                await asyncio.wait_for(self._due.wait(), self.flush_seconds)
            except asyncio.TimeoutError:
                pass
            self._due.clear()
            if not await self.flush():
                await asyncio.sleep(RETRY_S)
                if self.waiting:
                    self._due.set()


def ledger_metrics(ledger: LedgerWriter):
    """For the router's /metrics (a StateCollector)."""
    yield CounterMetricFamily("qos_ledger_rows_written", "Ledger rows written to the store", value=ledger.written)
    yield CounterMetricFamily("qos_ledger_unconfirmed", "Final chunks sent before the store confirmed their "
                              "request's ledger row (the row stays queued)", value=ledger.unconfirmed)
    yield GaugeMetricFamily("qos_ledger_pending_rows", "Ledger rows waiting to be written", value=len(ledger.pending))
