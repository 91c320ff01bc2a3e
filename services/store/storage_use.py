"""What each tenant keeps in the store, in bytes, and the limit on it.

A tenant's files (batch inputs and outputs), kept Responses API answers and conversations live in
the database every tenant shares: without a limit one tenant could fill its disk and stop the
billing and the keys of all. `tenant_storage` holds each tenant's running total, moved in the same
transaction as every write and delete of those rows (as tenant_spend moves with the ledger), so
the routers read it in one indexed row instead of summing a tenant's rows.

A write that would take a tenant past its limit raises StorageFull and its transaction rolls
back. The total's row is updated first in that transaction, so on PostgreSQL it stays locked until
the commit: two router replicas writing for one tenant at once never both pass the limit.
What counts: a file's bytes; a kept response's JSON (its input items and the response object); a
conversation's metadata JSON and each item's. A deleted or expired row's bytes leave the total
when its row is deleted or emptied.
"""
from __future__ import annotations

from sqlalchemy import func, select, union_all

from services.store.connect import upsert_for
from services.store.schema import conversation_items, conversations, files, responses, tenant_storage


class StorageFull(Exception):
    """A write that would take its tenant past its storage limit (its transaction rolls back)."""

    def __init__(self, tenant: str, used: int, adding: int, limit: int):
        super().__init__(f"tenant {tenant} keeps {used} bytes of its {limit}; {adding} more do not fit")
        self.tenant, self.used, self.adding, self.limit = tenant, used, adding, limit


def move(db, tenant: str, delta: int, limit: int | None = None) -> None:
    """The tenant's total moved by `delta` bytes, in the caller's transaction. With a limit, an
    addition past it raises StorageFull (a removal never does, however high the total is)."""
    if delta == 0:
        return
    upsert = upsert_for(db.dialect.name)
    statement = upsert(tenant_storage).values(tenant=tenant, bytes=delta).on_conflict_do_update(
        index_elements=["tenant"], set_={"bytes": tenant_storage.c.bytes + delta}).returning(tenant_storage.c.bytes)
    total = db.execute(statement).scalar()
    if limit is not None and delta > 0 and total > limit:
        raise StorageFull(tenant, total - delta, delta, limit)


def move_each(db, deltas: dict[str, int]) -> None:
    """Several tenants' totals moved (rows deleted by a purge), in one order: two transactions
    moving the same tenants never wait on each other in a circle."""
    for tenant in sorted(deltas):
        move(db, tenant, deltas[tenant])


def used_by(engine, tenant: str | None) -> int:
    """The tenant's bytes now (one row by its key); None: every tenant's."""
    query = select(func.sum(tenant_storage.c.bytes)) if tenant is None else \
        select(tenant_storage.c.bytes).where(tenant_storage.c.tenant == tenant)
    with engine.connect() as db:
        return int(db.execute(query).scalar() or 0)


def counted(db) -> dict[str, int]:
    """Each tenant's bytes summed from the rows themselves (what the totals must equal): for the
    upgrade that starts the totals, and for the tests that hold them to it."""
    rows = union_all(
        select(files.c.tenant, files.c.bytes),
        select(responses.c.tenant, responses.c.bytes),
        select(conversations.c.tenant, conversations.c.bytes),
        select(conversations.c.tenant, conversation_items.c.bytes)
        .join(conversations, conversations.c.id == conversation_items.c.conversation_id)).subquery()
    query = select(rows.c.tenant, func.sum(rows.c.bytes).label("bytes")).group_by(rows.c.tenant)
    return {row.tenant: int(row.bytes) for row in db.execute(query) if row.bytes}


def recount(db) -> None:
    """The totals set from the rows (the upgrade to the schema that added them)."""
    db.execute(tenant_storage.delete())
    totals = counted(db)
    if totals:
        db.execute(tenant_storage.insert(), [{"tenant": t, "bytes": b} for t, b in sorted(totals.items())])
