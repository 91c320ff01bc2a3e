"""The tenant and billing store on SQLite and on a real PostgreSQL server: schema and its version,
keys stored only as hashes, revocation, the ledger's one row per request, bills that add up."""
from __future__ import annotations

import hashlib

import pytest
from sqlalchemy import text, update

from services.store.billing import parse_since, report
from services.store.schema import SCHEMA_VERSION, schema_info
from services.store.store import Store, StoreError, Tenant


@pytest.fixture
def store(url):
    store = Store(url)
    with store.engine.begin() as db:       # each test starts empty
        for table in ("ledger", "tenant_spend", "limit_shares", "api_keys", "tenants"):
            db.execute(text(f"DELETE FROM {table}"))
    yield store
    store.close()


def row(request_id: str, tenant: str = "acme", priority: str = "low", amount: float = 1.0, **extra) -> dict:
    return {"request_id": request_id, "tenant": tenant, "key_prefix": "qsk_x", "priority": priority,
            "pool": "cpu", "device": "cpu", "model": "m", "prompt_tokens": 10, "completion_tokens": 5,
            "price_per_token": 0.1, "multiplier": 1.0, "amount": amount, "outcome": "completed",
            "started_at": 1_800_000_000.0, "finished_at": 1_800_000_001.0, **extra}


def test_tenants_are_added_changed_and_refused_precisely(store):
    store.add_tenant(Tenant("acme", priorities=("medium", "low"), rpm=60, budget=10.0))
    with pytest.raises(StoreError, match="tenant 'acme' exists already"):
        store.add_tenant(Tenant("acme"))
    with pytest.raises(StoreError, match="priorities must be some of high, medium, low"):
        store.add_tenant(Tenant("x", priorities=("urgent",)))
    with pytest.raises(StoreError, match="rpm must be >= 1"):
        store.set_tenant("acme", rpm=0)
    changed = store.set_tenant("acme", tpm=1000, weight=2.0, clear=["rpm"])
    assert (changed.rpm, changed.tpm, changed.weight, changed.budget) == (None, 1000, 2.0, 10.0)
    with pytest.raises(StoreError, match="no tenant named 'nobody'"):
        store.set_tenant("nobody", rpm=1)


def test_keys_are_stored_only_as_hashes_and_revocation_sticks(store):
    store.add_tenant(Tenant("acme"))
    key, prefix = store.create_key("acme")
    assert key.startswith("qsk_") and prefix == key[:12] and len(key) > 40
    with store.engine.connect() as db:
        stored = [tuple(r) for r in db.execute(text("SELECT prefix, key_hash FROM api_keys"))]
    assert stored == [(prefix, hashlib.sha256(key.encode()).hexdigest())]
    assert not any(key in value for value in stored[0])
    assert store.active_keys() == {hashlib.sha256(key.encode()).hexdigest(): ("acme", prefix)}
    assert store.revoke_key(prefix) == "acme"
    assert store.active_keys() == {} and store.keys()[0][3] is not None
    with pytest.raises(StoreError, match="no key with prefix"):
        store.revoke_key("qsk_nothere")
    with pytest.raises(StoreError, match="no tenant named 'ghost'"):
        store.create_key("ghost")


def test_the_ledger_never_holds_two_rows_for_one_request(store):
    assert store.write_ledger([row("r1"), row("r2", amount=2.5)]) == 2
    assert store.write_ledger([row("r2", amount=99.0), row("r3")]) == 1     # a retried batch
    rows = store.ledger_rows()
    assert [r["request_id"] for r in rows] == ["r1", "r2", "r3"]
    assert store.spent() == {"acme": 4.5}
    assert [r["amount"] for r in store.ledger_rows(request_id="r2")] == [2.5]


def test_bills_add_up_by_every_grouping(store):
    store.write_ledger([row(f"r{i}", tenant=t, priority=p, amount=a, finished_at=1_800_000_000.0 + day * 86400)
                        for i, (t, p, a, day) in enumerate([("acme", "high", 3.0, 0), ("acme", "low", 1.0, 1),
                                                            ("beta", "low", 0.5, 1), ("beta", "medium", 2.25, 2)])])
    rows = store.ledger_rows()
    for by in ("tenant", "day", "priority", "pool", "model"):
        lines, total = report(rows, by)
        assert sum(l.amount for l in lines) == pytest.approx(total.amount) == 6.75
        assert sum(l.requests for l in lines) == total.requests == 4
        assert sum(l.completion_tokens for l in lines) == total.completion_tokens == 20
    assert [l.group for l in report(rows, "day")[0]] == ["2027-01-15", "2027-01-16", "2027-01-17"]
    assert report(store.ledger_rows(tenant="beta", since=parse_since("2027-01-16")), "tenant")[1].amount == 2.75


def test_a_newer_schema_is_refused_with_a_message(url):
    store = Store(url)
    with store.engine.begin() as db:
        db.execute(update(schema_info).values(version=99))
    store.close()
    try:
        with pytest.raises(StoreError, match="schema version 99, newer than this qos-serve knows"):
            Store(url)
    finally:
        fix = Store.__new__(Store)
        from services.store.connect import make_engine
        fix.engine = make_engine(url)
        with fix.engine.begin() as db:
            db.execute(update(schema_info).values(version=SCHEMA_VERSION))
        fix.engine.dispose()


def test_a_version_1_database_is_upgraded_with_each_tenants_spending_summed(url):
    store = Store(url)
    with store.engine.begin() as db:
        db.execute(text("DELETE FROM ledger"))
    store.write_ledger([row("u1", amount=1.5), row("u2", amount=2.0), row("u3", tenant="beta", amount=0.25)])
    with store.engine.begin() as db:        # as version 1 left it: no running totals
        db.execute(text("DROP TABLE tenant_spend"))
        db.execute(update(schema_info).values(version=1))
    store.close()
    store = Store(url)
    try:
        assert store.spent() == {"acme": 3.5, "beta": 0.25}
        store.write_ledger([row("u4", amount=1.0)])
        assert store.spent()["acme"] == 4.5
    finally:
        with store.engine.begin() as db:
            db.execute(text("DELETE FROM ledger"))
            db.execute(text("DELETE FROM tenant_spend"))
        store.close()


def test_a_version_2_ledger_gains_cached_tokens_and_its_rows_stay_billed_in_full(url):
    store = Store(url)
    with store.engine.begin() as db:
        db.execute(text("DELETE FROM ledger"))
        db.execute(text("DELETE FROM tenant_spend"))
    store.write_ledger([row("v1", amount=1.5)])
    with store.engine.begin() as db:        # as version 2 left it
        db.execute(text("ALTER TABLE ledger DROP COLUMN cached_tokens"))
        db.execute(text("ALTER TABLE ledger DROP COLUMN cached_fraction"))
        db.execute(update(schema_info).values(version=2))
    store.close()
    store = Store(url)
    try:
        store.write_ledger([row("v2", amount=0.75, cached_tokens=12, cached_fraction=0.5)])
        rows = {r["request_id"]: r for r in store.ledger_rows()}
        assert (rows["v1"]["cached_tokens"], rows["v1"]["cached_fraction"]) == (0, 1.0)
        assert (rows["v2"]["cached_tokens"], rows["v2"]["cached_fraction"]) == (12, 0.5)
        assert store.spent() == {"acme": 2.25}
    finally:
        with store.engine.begin() as db:
            db.execute(text("DELETE FROM ledger"))
            db.execute(text("DELETE FROM tenant_spend"))
        store.close()


def _open_store(url: str) -> int:
    Store(url).close()
    return 0


def test_router_replicas_starting_together_prepare_a_fresh_database_once(tmp_path, url):
    """Six processes open a database no one has created yet, at once (as replicas at start-up)."""
    import multiprocessing
    fresh = f"sqlite:///{tmp_path}/fresh.db" if url.startswith("sqlite") else url
    if not url.startswith("sqlite"):            # an empty PostgreSQL schema: drop what the fixture made
        store = Store(url)
        from services.store.schema import metadata
        metadata.drop_all(store.engine)
        store.close()
    with multiprocessing.get_context("spawn").Pool(6) as pool:
        assert pool.map(_open_store, [fresh] * 6) == [0] * 6
    store = Store(fresh)
    try:
        with store.engine.connect() as db:
            assert db.execute(text("SELECT version FROM schema_info")).scalars().all() == [SCHEMA_VERSION]
    finally:
        store.close()
