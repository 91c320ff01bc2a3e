"""The router's ledger writer (services/control/ledger.py) on a fake store: a completed
request's row is committed before commit() returns, rows finishing together share one
transaction, a store that fails keeps the rows and retries them, one that does not answer in
time lets the caller go on with the row still queued, and nothing is written twice."""
from __future__ import annotations

import asyncio
import threading

from services.control import ledger as ledger_module
from services.control.ledger import LedgerWriter, ledger_metrics


class FakeStore:
    url = "fake://"

    def __init__(self):
        self.rows: dict[str, dict] = {}
        self.transactions = 0
        self.fail = 0                   # fail this many writes
        self.gate = threading.Event()   # cleared: writes block until set
        self.gate.set()

    def write_ledger(self, rows):
        self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise OSError("database is down")
        self.transactions += 1
        new = [r for r in rows if r["request_id"] not in self.rows]
        self.rows.update((r["request_id"], r) for r in new)
        return len(new)


def row(i: int) -> dict:
    return {"request_id": f"r{i}", "amount": float(i)}


async def with_writer(store, body, flush_seconds=60.0):
    writer = LedgerWriter(store, flush_seconds)
    task = asyncio.create_task(writer.run())
    try:
        return await body(writer)
    finally:
        task.cancel()


def test_commit_returns_once_the_row_is_in_the_store_and_concurrent_commits_share_transactions():
    store = FakeStore()

    async def body(writer):
        assert await writer.commit(row(0)) and "r0" in store.rows
        results = await asyncio.gather(*(writer.commit(row(i)) for i in range(1, 41)))
        return results

    results = asyncio.run(with_writer(store, body))
    assert all(results) and len(store.rows) == 41
    assert store.transactions < 41 // 2          # group commit: far fewer transactions than rows


def test_recorded_rows_wait_for_the_batch_and_go_with_the_next_commit():
    store = FakeStore()

    async def body(writer):
        writer.record(row(1))                        # a cancelled request's row: no wait
        await asyncio.sleep(0.05)
        assert "r1" not in store.rows                # flush_seconds is 60 s
        await writer.commit(row(2))
        return writer

    writer = asyncio.run(with_writer(store, body))
    assert set(store.rows) == {"r1", "r2"} and writer.written == 2


def test_a_failing_store_keeps_the_rows_and_commit_waits_for_the_retry(monkeypatch):
    monkeypatch.setattr(ledger_module, "RETRY_S", 0.01)
    store = FakeStore()
    store.fail = 2

    async def body(writer):
        return await writer.commit(row(7))

    assert asyncio.run(with_writer(store, body)) is True
    assert store.rows["r7"]["amount"] == 7.0


def test_a_store_that_does_not_answer_in_time_lets_the_chunk_go_and_writes_the_row_later(monkeypatch):
    monkeypatch.setattr(ledger_module, "COMMIT_WAIT_S", 0.05)
    store = FakeStore()
    store.gate.clear()

    async def body(writer):
        confirmed = await writer.commit(row(3))
        unconfirmed = writer.unconfirmed
        store.gate.set()                           # the database answers again
        for _ in range(100):
            if "r3" in store.rows:
                break
            await asyncio.sleep(0.01)
        metrics = {m.name: m.samples[0].value for m in ledger_metrics(writer)}
        return confirmed, unconfirmed, metrics

    confirmed, unconfirmed, metrics = asyncio.run(with_writer(store, body))
    assert confirmed is False and unconfirmed == 1 and "r3" in store.rows
    assert metrics["qos_ledger_unconfirmed"] == 1 and metrics["qos_ledger_rows_written"] == 1


def test_a_request_id_is_never_written_twice():
    store = FakeStore()

    async def body(writer):
        await writer.commit(row(5))
        writer.record(row(5))
        await writer.flush()
        return writer

    writer = asyncio.run(with_writer(store, body))
    assert writer.written == 1 and len(store.rows) == 1


class RefusingStore(FakeStore):
    """Refuses any batch holding a row marked bad, as PostgreSQL refuses a value too long."""

    def write_ledger(self, rows):
        if any(r.get("bad") for r in rows):
            from sqlalchemy.exc import DataError
            raise DataError("INSERT INTO ledger ...", {}, Exception("value too long for type character varying(64)"))
        return super().write_ledger(rows)


def test_one_refused_row_is_counted_and_never_holds_back_its_batch_or_later_ones(monkeypatch):
    monkeypatch.setattr(ledger_module, "COMMIT_WAIT_S", 0.5)
    store = RefusingStore()

    async def body(writer):
        first = await asyncio.gather(*(writer.commit({**row(i), "bad": i == 2}) for i in range(5)))
        later = await writer.commit(row(9))
        return first, later, writer

    first, later, writer = asyncio.run(with_writer(store, body))
    assert first == [True, True, False, True, True] and later is True
    assert set(store.rows) == {"r0", "r1", "r3", "r4", "r9"}
    assert writer.refused == 1 and not writer.pending and writer.unconfirmed == 0


def test_pending_rows_are_bounded_oldest_dropped_and_counted(monkeypatch):
    monkeypatch.setattr(ledger_module, "RETRY_S", 0.01)
    store = FakeStore()
    store.fail = 10**9                   # down until told otherwise

    async def body(writer):
        for i in range(12):
            writer.record(row(i))
        assert not await writer.flush()
        assert [r["request_id"] for r in writer.pending] == [f"r{i}" for i in range(7, 12)]
        store.fail = 0
        assert await writer.flush()
        return writer

    writer = LedgerWriter(store, 60.0, max_pending=5)
    writer = asyncio.run(body(writer))
    metrics = {m.name: m.samples[0].value for m in ledger_metrics(writer)}
    assert set(store.rows) == {f"r{i}" for i in range(7, 12)}
    assert metrics["qos_ledger_rows_dropped"] == 7 and metrics["qos_ledger_pending_rows"] == 0


def test_while_the_store_is_down_completions_do_not_wait_and_no_waiter_is_kept(monkeypatch):
    monkeypatch.setattr(ledger_module, "COMMIT_WAIT_S", 0.3)
    monkeypatch.setattr(ledger_module, "RETRY_S", 0.01)
    store = FakeStore()
    store.fail = 10**9

    async def body(writer):
        assert await writer.commit(row(0)) is False          # the first one waits COMMIT_WAIT_S
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(writer.commit(row(i)) for i in range(1, 200)))
        took = asyncio.get_running_loop().time() - started
        waiting = len(writer.waiting)
        store.fail = 0
        for _ in range(200):
            if len(store.rows) == 200 and not writer.failing:
                break
            await asyncio.sleep(0.01)
        return results, took, waiting, writer

    results, took, waiting, writer = asyncio.run(with_writer(store, body, flush_seconds=0.05))
    assert not any(results) and took < 0.1 and waiting == 0
    assert len(store.rows) == 200 and writer.unconfirmed == 200 and writer.failing is False
