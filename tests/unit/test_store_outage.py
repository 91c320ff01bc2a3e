"""The store when things go wrong, on SQLite and a throwaway PostgreSQL: a database that stops
answering (tests/blackhole.py) fails each call within its stated bound instead of holding a helper
thread for ever, and the same Store works again once it answers; a ledger row the database refuses
goes alone and holds back nothing; /v1/usage's totals are summed by the database."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from services.control.ledger import LedgerWriter, ledger_metrics
from services.store.billing import report
from services.store.store import Store, Tenant
from tests.blackhole import BlackHoleProxy
from tests.unit.test_store import row


@pytest.fixture
def store(url):
    store = Store(url)
    with store.engine.begin() as db:
        for table in ("ledger", "tenant_spend", "api_keys", "tenants"):
            db.execute(text(f"DELETE FROM {table}"))
    yield store
    store.close()


def within(seconds: float, call):
    """call() in a thread; its error or result, or a failure if it is still running after `seconds`
    (a hang is a failed test, not a stuck run)."""
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(_attempt(call)), daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting for the database after {seconds} s"
    return outcome[0], time.monotonic() - started


def _attempt(call):
    try:
        return call()
    except Exception as error:
        return error


def test_usage_is_summed_by_the_database_and_matches_the_rows(store):
    store.write_ledger([row(f"r{i}", tenant=t, priority=p, amount=a, prompt_tokens=n)
                        for i, (t, p, a, n) in enumerate([("acme", "high", 3.0, 7), ("acme", "low", 1.25, 3),
                                                          ("acme", "low", 0.5, 4), ("beta", "low", 2.0, 9)])])
    lines = store.usage_lines()
    assert [(l["tenant"], l["priority"], l["requests"], l["prompt_tokens"]) for l in lines] == [
        ("acme", "high", 1, 7), ("acme", "low", 2, 7), ("beta", "low", 1, 9)]
    assert all(type(l[k]) is int for l in lines for k in ("requests", "prompt_tokens", "completion_tokens"))
    assert sum(l["amount"] for l in lines) == report(store.ledger_rows())[1].amount == 6.75
    assert store.usage_lines(tenant="acme", since=1_800_000_000.5)[1]["amount"] == 1.75
    assert store.usage_lines(tenant="nobody") == []


def test_a_row_the_database_refuses_goes_alone_and_the_rest_of_its_batch_is_billed(store):
    bad = row("bad", tenant=None)           # NOT NULL: refused by SQLite and PostgreSQL alike

    async def body():
        writer = LedgerWriter(store, flush_seconds=60.0)
        task = asyncio.create_task(writer.run())
        try:
            results = await asyncio.gather(writer.commit(row("a")), writer.commit(bad), writer.commit(row("b")))
            writer.record(row("c"))
            await writer.flush()
            return results, writer
        finally:
            task.cancel()

    results, writer = asyncio.run(body())
    assert results == [True, False, True]
    assert sorted(r["request_id"] for r in store.ledger_rows()) == ["a", "b", "c"]
    metrics = {m.name: m.samples[0].value for m in ledger_metrics(writer)}
    assert metrics["qos_ledger_rows_refused"] == 1 and metrics["qos_ledger_pending_rows"] == 0
    assert writer.failing is False and store.spent() == {"acme": 3.0}


def test_a_database_that_stops_answering_fails_each_call_within_its_bound(url):
    if not url.startswith("postgresql"):
        pytest.skip("SQLite is a local file")
    server = make_url(url)
    with BlackHoleProxy(server.host, server.port) as proxy:
        store = Store(server.set(port=proxy.port).render_as_string(hide_password=False),
                      connect_timeout_s=2, statement_timeout_s=1)
        try:
            store.add_tenant(Tenant("slow", rpm=5))
            assert Tenant("slow", rpm=5) in store.snapshot()[1]

            def sleep():
                with store.engine.connect() as db:
                    db.exec_driver_sql("SELECT pg_sleep(3)")
            error, took = within(5, sleep)
            assert isinstance(error, OperationalError) and "statement timeout" in str(error) and took < 2.5

            proxy.black_hole()
            # A pooled connection: no answer within statement_timeout + 1 s, then a new one: no
            # connection within connect_timeout.
            error, took = within(8, store.snapshot)
            assert isinstance(error, OperationalError) and took < 6, (error, took)
            error, took = within(8, lambda: store.write_ledger([row("r1")]))
            assert isinstance(error, OperationalError) and took < 4, (error, took)

            proxy.restore()
            for _ in range(20):             # held connections and queries drain through first
                if not isinstance(_attempt(store.snapshot), Exception):
                    break
                time.sleep(0.2)
            assert Tenant("slow", rpm=5) in store.snapshot()[1]
            assert store.write_ledger([row("r2")]) == 1
        finally:
            store.close()
