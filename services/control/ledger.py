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
loses those. The router's drain flushes what is left before it exits.

The request id is the table's key and rows are inserted with ON CONFLICT DO NOTHING, so a batch
retried after an error, or a request retried under the same id, never writes a row twice; a request
that never produced a token writes no row.

While the store cannot take rows (unreachable, or slower than its timeouts:
services/store/connect.py) they wait in memory, at most [billing] max_pending_rows (then the oldest
go, counted in qos_ledger_rows_dropped; one batch being written is held besides), and completions
stop waiting: after the first failed write each final chunk goes at once, its row queued. A batch
the database refuses for its data (a value it will not store) goes again row by row, so one bad row
never holds back the others; the refused row is logged with what it would have billed, counted
(qos_ledger_rows_refused) and not retried.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.store.store import Store, refused_for_its_data

log = logging.getLogger(__name__)

MAX_PENDING = 100_000       # rows kept while the store cannot take them, then the oldest go
MAX_BATCH = 1_000           # rows a transaction: a backlog goes in steps well inside statement_timeout
COMMIT_WAIT_S = 2.0         # the longest a final chunk waits for its row to be committed
RETRY_S = 0.5               # after a failed write


@dataclass(slots=True)
class BatchResult:
    new: int = 0                                            # rows the store did not hold yet
    refused: list[tuple[dict, Exception]] = field(default_factory=list)
    left: list[dict] = field(default_factory=list)          # not written: the store failed
    error: Exception | None = None


class LedgerWriter:
    def __init__(self, store: Store, flush_seconds: float = 1.0, max_pending: int = MAX_PENDING):
        self.store = store
        self.flush_seconds = flush_seconds
        self.max_pending = max_pending
        self.pending: deque[dict] = deque()
        self.waiting: dict[str, asyncio.Future] = {}    # request id -> its commit() caller, while it waits
        self.written = self.refused = self.dropped = 0
        self.writing = 0                                # rows of the batch being written
        self.unconfirmed = 0                            # final chunks sent before their row was committed
        self.failing = False                            # the last write failed: commit() does not wait
        self._due = asyncio.Event()
        self._lock = asyncio.Lock()                     # one write at a time; the next batch gathers

    def record(self, row: dict) -> None:
        """A row written with the next batch (at most flush_seconds from now)."""
        self.pending.append(row)
        self._trim()

    def _trim(self) -> None:
        over = len(self.pending) - self.max_pending
        if over <= 0:
            return
        for _ in range(over):
            self._settle(self.pending.popleft()["request_id"], False)
        self.dropped += over
        log.error("ledger: %d rows wait for %s, more than max_pending_rows; dropped the %d oldest "
                  "(%d in all)", len(self.pending) + over, self.store.url, over, self.dropped)

    def _settle(self, request_id: str, written: bool) -> None:
        done = self.waiting.get(request_id)
        if done is not None and not done.done():
            done.set_result(written)

    async def commit(self, row: dict) -> bool:
        """The row written now (with whatever else is pending); False if the store did not
        confirm it within COMMIT_WAIT_S (it stays queued), refused it, or is failing already."""
        request_id = row["request_id"]
        if self.failing:
            self.record(row)
            self.unconfirmed += 1
            return False
        done = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = done
        self.record(row)
        self._due.set()
        try:
            return await asyncio.wait_for(asyncio.shield(done), COMMIT_WAIT_S)
        except asyncio.TimeoutError:
            self.unconfirmed += 1
            log.error("ledger: request %s's row not confirmed by %s within %.0f s; its final chunk goes "
                      "now, the row stays queued", request_id, self.store.url, COMMIT_WAIT_S)
            return False
        finally:
            if self.waiting.get(request_id) is done:
                del self.waiting[request_id]

    def _write(self, rows: list[dict]) -> BatchResult:
        """In a helper thread. A batch the database refuses for its data goes again row by row: one
        bad row never holds back the others, and is itself not retried."""
        result = BatchResult()
        try:
            result.new = self.store.write_ledger(rows)
            return result
        except Exception as error:
            if not refused_for_its_data(error):
                result.left, result.error = rows, error
                return result
        for i, row in enumerate(rows):
            try:
                result.new += self.store.write_ledger([row])
            except Exception as error:
                if not refused_for_its_data(error):
                    result.left, result.error = rows[i:], error
                    return result
                result.refused.append((row, error))
        return result

    async def flush(self) -> bool:
        """Write everything pending, MAX_BATCH rows a transaction; True when all of it went in
        (or was refused), False when the store failed (what is left stays, oldest first)."""
        async with self._lock:
            while self.pending:
                batch = [self.pending.popleft() for _ in range(min(MAX_BATCH, len(self.pending)))]
                self.writing = len(batch)
                try:
                    result = await asyncio.to_thread(self._write, batch)
                finally:
                    self.writing = 0
                self.written += result.new
                for row, error in result.refused:
                    self.refused += 1
                    log.error("ledger: %s refused request %s's row (tenant %r, %d+%d tokens, %.6f cost "
                              "units): %s; it is not retried", self.store.url, row["request_id"],
                              row.get("tenant"), row.get("prompt_tokens", 0), row.get("completion_tokens", 0),
                              row.get("amount", 0.0), str(error).splitlines()[0])
                    self._settle(row["request_id"], False)
                for row in batch[:len(batch) - len(result.left)]:
                    self._settle(row["request_id"], True)       # refused ones are settled already
                if result.left:
                    self.pending.extendleft(reversed(result.left))
                    self._trim()
                    if not self.failing:
                        log.error("ledger: writing to %s failed (%s); %d rows wait, completions no longer "
                                  "wait for their row", self.store.url, result.error, len(self.pending))
                    self.failing = True
                    return False
            if self.failing:
                log.warning("ledger: %s takes rows again", self.store.url)
            self.failing = False
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
    yield CounterMetricFamily("qos_ledger_rows_refused", "Ledger rows the store refused for their data "
                              "(logged with what they would have billed; not retried)", value=ledger.refused)
    yield CounterMetricFamily("qos_ledger_rows_dropped", "Ledger rows dropped, oldest first, while more than "
                              "[billing] max_pending_rows waited for the store", value=ledger.dropped)
    yield GaugeMetricFamily("qos_ledger_pending_rows", "Ledger rows waiting to be written (the batch being "
                            "written included)", value=len(ledger.pending) + ledger.writing)
