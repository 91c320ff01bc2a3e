"""Each tenant's storage in the store (services/store/storage_use.py) and its limit
(services/control/storage_quota.py), on SQLite and PostgreSQL: the running totals equal the rows'
sizes after any mix of writes and deletes; a write past the limit writes nothing; two replicas
writing at once never both pass it; a database from before the totals is upgraded to them."""
from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest
from sqlalchemy import text

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import ADMIN_TENANT
from services.control.storage_quota import MB, require_room, storage_limit, storage_refusal
from services.control.tenancy import Caller, TenantBook
from services.store import storage_use
from services.store.batch_store import BatchStore
from services.store.conversation_store import ConversationStore
from services.store.response_store import ResponseStore
from services.store.store import Store, StoreError, Tenant

TENANTS = ("alpha", "beta", "gamma")
TABLES = ("files", "responses", "conversations", "conversation_items", "tenant_storage")


@pytest.fixture
def store(url):
    opened = Store(url)
    with opened.engine.begin() as db:
        for table in TABLES:
            db.execute(text(f"DELETE FROM {table}"))
    yield opened
    opened.close()


def totals(store: Store) -> dict[str, int]:
    with store.engine.connect() as db:
        kept = {row.tenant: row.bytes for row in db.execute(text("SELECT tenant, bytes FROM tenant_storage"))}
    return {tenant: size for tenant, size in kept.items() if size}


def counted(store: Store) -> dict[str, int]:
    with store.engine.connect() as db:
        return storage_use.counted(db)


def response(rid: str, status: str = "completed", text_: str = "Hello there.") -> dict:
    return {"id": rid, "object": "response", "status": status, "background": status != "completed",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": text_}]}]}


def item(n: int, size: int) -> dict:
    return {"id": f"msg_{n}", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "x" * size}]}


def test_the_totals_equal_the_rows_after_any_mix_of_writes_and_deletes(store):
    files, kept, talks = BatchStore(store), ResponseStore(store), ConversationStore(store)
    rng = random.Random(7)
    file_ids, response_ids, conversation_ids, running = [], [], [], []
    n = 0
    for step in range(160):
        n += 1
        tenant, now = rng.choice(TENANTS), 1000.0 + step
        action = rng.randrange(11)
        if action == 0:
            file_ids.append(files.add_file(tenant, "batch", "f.jsonl", b"x" * rng.randrange(1, 5000), now)["id"])
        elif action == 1 and file_ids:
            files.delete_file(rng.choice([None, tenant]), file_ids.pop(rng.randrange(len(file_ids))))
        elif action == 2:
            status = rng.choice(["completed", "queued"])
            kept.add(tenant, response(f"resp_{n}", status, "y" * rng.randrange(100)), [item(n, rng.randrange(300))],
                     now, now + rng.choice([5.0, 500.0]), owner="me" if status == "queued" else None,
                     lease_until=now + 60)
            (running if status == "queued" else response_ids).append(f"resp_{n}")
        elif action == 3 and running:           # a background response grows as it runs, then ends
            rid = rng.choice(running)
            status = rng.choice(["in_progress", "completed"])
            if kept.update(response(rid, status, "z" * rng.randrange(2000)), "me") and status == "completed":
                running.remove(rid)
        elif action == 4 and running:
            kept.cancel(None, running.pop(rng.randrange(len(running))), now)
        elif action == 5 and response_ids:
            kept.delete(rng.choice([None, tenant]), rng.choice(response_ids), now)
        elif action == 6:
            kept.purge(now)
        elif action == 7:
            conversation_ids.append(talks.create(f"conv_{n}", tenant, {"k": "v" * rng.randrange(50)},
                                                 [item(n, rng.randrange(400))], now)["id"])
        elif action == 8 and conversation_ids:
            cid = rng.choice(conversation_ids)
            talks.append(None, cid, [item(n * 10 + k, rng.randrange(400)) for k in range(rng.randrange(1, 4))])
            talks.set_metadata(None, cid, {"note": "w" * rng.randrange(80)})
        elif action == 9 and conversation_ids:
            cid = rng.choice(conversation_ids)
            items = talks.items(cid)
            if items:
                talks.delete_item(cid, rng.choice(items)["id"])
        elif action == 10 and conversation_ids:
            talks.delete(None, conversation_ids.pop(rng.randrange(len(conversation_ids))))
        assert totals(store) == counted(store), f"step {step}, action {action}"
    assert sum(totals(store).values()) > 0


def test_a_write_past_the_limit_writes_nothing_and_a_delete_makes_room(store):
    files, talks = BatchStore(store), ConversationStore(store)
    first = files.add_file("alpha", "batch", "a.jsonl", b"x" * 600, 1.0, limit=1000)
    with pytest.raises(storage_use.StorageFull) as full:
        files.add_file("alpha", "batch", "b.jsonl", b"x" * 600, 2.0, limit=1000)
    assert (full.value.used, full.value.adding, full.value.limit) == (600, 600, 1000)
    assert len(files.files("alpha", None, None, 10)) == 1 and totals(store) == {"alpha": 600}
    files.add_file("beta", "batch", "b.jsonl", b"x" * 600, 2.0, limit=1000)      # another tenant: its own room
    with pytest.raises(storage_use.StorageFull):
        talks.create("conv_1", "alpha", {}, [item(1, 500)], 3.0, limit=1000)
    assert talks.get(None, "conv_1") is None
    assert files.delete_file("alpha", first["id"])
    talks.create("conv_1", "alpha", {}, [item(1, 500)], 3.0, limit=1000)
    with pytest.raises(storage_use.StorageFull):
        talks.append("alpha", "conv_1", [item(2, 500)], limit=1000)
    assert [i["id"] for i in talks.items("conv_1")] == ["msg_1"]
    assert talks.append("alpha", "conv_1", [item(2, 500)])     # no limit: a response's turn, let in before
    assert totals(store) == counted(store)


def test_two_replicas_adding_at_once_never_both_pass_the_limit(store):
    """Each round two threads (two routers' helper threads) add a 600-byte file for one tenant
    whose limit is 1000: exactly one succeeds."""
    for round_ in range(8):
        files, gate, outcomes = BatchStore(store), threading.Barrier(2), []

        def add(name: str) -> None:
            gate.wait()
            try:
                files.add_file(f"t{round_}", "batch", name, b"x" * 600, 1.0, limit=1000)
                outcomes.append("kept")
            except storage_use.StorageFull:
                outcomes.append("full")
        threads = [threading.Thread(target=add, args=(name,)) for name in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes) == ["full", "kept"], round_
    assert totals(store) == counted(store)


def test_a_database_from_before_the_totals_is_upgraded_to_them(url):
    store = Store(url)
    with store.engine.begin() as db:
        for table in TABLES:
            db.execute(text(f"DELETE FROM {table}"))
    BatchStore(store).add_file("alpha", "batch", "a.jsonl", b"x" * 700, 1.0)
    ResponseStore(store).add("alpha", response("resp_1"), [item(1, 100)], 1.0, 1e12)
    ConversationStore(store).create("conv_1", "beta", {"a": "b"}, [item(2, 50)], 1.0)
    expected = counted(store)
    with store.engine.begin() as db:         # as a version-5 database had them: no sizes, no totals
        db.execute(text("UPDATE schema_info SET version = 5"))
        db.execute(text("DROP TABLE tenant_storage"))
        for table in ("responses", "conversations", "conversation_items"):
            db.execute(text(f"ALTER TABLE {table} DROP COLUMN bytes"))
        db.execute(text("ALTER TABLE tenants DROP COLUMN storage_mb"))
    store.close()
    upgraded = Store(url)
    kept_json = len(json.dumps([item(1, 100)])) + len(json.dumps(response("resp_1")))
    talk_json = len(json.dumps({"a": "b"})) + len(json.dumps(item(2, 50)))
    assert expected == {"alpha": 700 + kept_json, "beta": talk_json}
    assert totals(upgraded) == counted(upgraded) == expected
    upgraded.add_tenant(Tenant("capped", storage_mb=5))
    assert upgraded.tenant("capped").storage_mb == 5
    upgraded.close()


def test_the_limit_is_the_tenants_own_else_the_default_and_the_admin_has_none():
    assert storage_limit(Caller(Tenant("a")), 1024) == 1024 * MB
    assert storage_limit(Caller(Tenant("a", storage_mb=3)), 1024) == 3 * MB
    assert storage_limit(Caller(Tenant("a", storage_mb=0)), 1024) == 0          # may keep nothing
    assert storage_limit(Caller(Tenant("a")), 0) is None                        # the default 0: no limit
    assert storage_limit(Caller(Tenant(ADMIN_TENANT), admin=True), 1024) is None
    with pytest.raises(StoreError, match="storage_mb must be 0-"):
        Store("sqlite://").add_tenant(Tenant("a", storage_mb=-1))


def test_the_refusal_is_a_429_that_says_what_makes_room(store):
    error = storage_refusal(storage_use.StorageFull("alpha", 1_500_000, 600_000, 2 * MB), "file")
    assert error.kind == ErrorKind.EXHAUSTED and error.reason == "storage_quota_exceeded" and error.field == "file"
    assert error.retry_after_ms is None
    assert "keeps 1.500 MB of its 2 MB" in str(error) and "needs 0.600 MB more" in str(error)
    assert "qos-serve tenants set alpha --storage-mb N" in str(error) and "send store false" in str(error)
    BatchStore(store).add_file("alpha", "batch", "a.jsonl", b"x" * 1_000_000, 1.0)
    book = TenantBook(store, storage_mb=1)
    require_room(book, Caller(Tenant("alpha")), "store")          # not read yet: nothing known kept
    asyncio.run(book.refresh())                                   # the router's copy, as it refreshes
    assert book.stored == {"alpha": 1_000_000}
    require_room(book, Caller(Tenant("alpha", storage_mb=2)), "store")                   # under: let in
    with pytest.raises(ServiceError, match="keeps 1.000 MB of its 1 MB") as refused:
        require_room(book, Caller(Tenant("alpha")), "store")                             # at it: refused
    assert refused.value.field == "store" and "MB more" not in str(refused.value)
    require_room(book, Caller(Tenant(ADMIN_TENANT), admin=True), "store")                # no limit
