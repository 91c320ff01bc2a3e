"""The Batch API's rows in the store (services/store/schema.py: files, batches, batch_results).
Synchronous SQLAlchemy, called from a helper thread, as the rest of the store.

Every read and write names its tenant (None: the admin's, any tenant): one tenant's file or batch
is, to another, an id that does not exist. A batch is run by one router replica at a time: it
claims the batch with a lease it renews, and a replica that stopped is replaced once its lease
is over. A finished line is written once (its row's key is the batch and the line), with the
batch's counts in the same transaction, so a batch resumed elsewhere runs only the lines left.
"""
from __future__ import annotations

import json
import secrets

from sqlalchemy import and_, delete, insert, or_, select, update

from services.store import storage_use
from services.store.schema import batch_results, batches, files, row_id
from services.store.store import Store

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")     # a runner has work to do
FILE_COLUMNS = (files.c.id, files.c.tenant, files.c.purpose, files.c.filename, files.c.bytes, files.c.created_at)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class BatchStore:
    def __init__(self, store: Store):
        self.engine = store.engine
        self.upsert = store._upsert()

    # --- files ------------------------------------------------------------------------------------

    def add_file(self, tenant: str, purpose: str, filename: str, content: bytes, now: float,
                 limit: int | None = None) -> dict:
        """Raises StorageFull (nothing written) when it would take the tenant past `limit` bytes."""
        row = {"id": new_id("file-"), "tenant": tenant, "purpose": purpose, "filename": filename,
               "bytes": len(content), "created_at": now}
        with self.engine.begin() as db:
            db.execute(insert(files).values(**row, content=content))
            storage_use.move(db, tenant, len(content), limit)
        return row

    def file(self, tenant: str | None, file_id: str) -> dict | None:
        if not row_id(file_id):
            return None
        with self.engine.connect() as db:
            row = db.execute(_owned(select(*FILE_COLUMNS), files, tenant, file_id)).first()
        return dict(row._mapping) if row else None

    def file_content(self, tenant: str | None, file_id: str) -> bytes | None:
        if not row_id(file_id):
            return None
        with self.engine.connect() as db:
            return db.execute(_owned(select(files.c.content), files, tenant, file_id)).scalar()

    def files(self, tenant: str | None, purpose: str | None, after: str | None, limit: int) -> list[dict]:
        query = select(*FILE_COLUMNS)
        if purpose is not None:
            query = query.where(files.c.purpose == purpose)
        return self._page(query, files, tenant, after, limit)

    def delete_file(self, tenant: str | None, file_id: str) -> bool:
        if not row_id(file_id):
            return False
        with self.engine.begin() as db:
            query = delete(files).where(files.c.id == file_id)
            if tenant is not None:
                query = query.where(files.c.tenant == tenant)
            gone = db.execute(query.returning(files.c.tenant, files.c.bytes)).first()
            if gone is not None:
                storage_use.move(db, gone.tenant, -gone.bytes)
            return gone is not None

    # --- batches ----------------------------------------------------------------------------------

    def add_batch(self, row: dict) -> dict:
        """The batch as stored (every column)."""
        with self.engine.begin() as db:
            db.execute(insert(batches).values(**row))
        return self.batch(None, row["id"])

    def batch(self, tenant: str | None, batch_id: str) -> dict | None:
        if not row_id(batch_id):
            return None
        with self.engine.connect() as db:
            row = db.execute(_owned(select(batches), batches, tenant, batch_id)).first()
        return dict(row._mapping) if row else None

    def batches(self, tenant: str | None, after: str | None, limit: int) -> list[dict]:
        return self._page(select(batches), batches, tenant, after, limit)

    def _page(self, query, table, tenant: str | None, after: str | None, limit: int) -> list[dict]:
        """A tenant's rows, newest first (OpenAI's order), from after the row `after`."""
        query = query.order_by(table.c.created_at.desc(), table.c.id.desc()).limit(limit)
        if tenant is not None:
            query = query.where(table.c.tenant == tenant)
        with self.engine.connect() as db:
            if after is not None and row_id(after):
                mark = db.execute(select(table.c.created_at).where(table.c.id == after)).scalar()
                if mark is not None:
                    query = query.where(or_(table.c.created_at < mark,
                                            and_(table.c.created_at == mark, table.c.id < after)))
            return [dict(r._mapping) for r in db.execute(query)]

    def cancel(self, tenant: str | None, batch_id: str, now: float) -> dict | None:
        """An active batch becomes `cancelling` (its runner stops and finalizes it); another is as it was."""
        if not row_id(batch_id):
            return None
        with self.engine.begin() as db:
            query = update(batches).where(batches.c.id == batch_id, batches.c.status.in_(ACTIVE[:3]))
            if tenant is not None:
                query = query.where(batches.c.tenant == tenant)
            db.execute(query.values(status="cancelling", cancelling_at=now))
        return self.batch(tenant, batch_id)

    def claim(self, replica: str, now: float, lease_s: float) -> dict | None:
        """An active batch nobody runs (or whose runner's lease is over), now this replica's."""
        with self.engine.begin() as db:
            free = or_(batches.c.owner.is_(None), batches.c.owner == replica, batches.c.lease_until < now)
            for row in db.execute(select(batches.c.id).where(batches.c.status.in_(ACTIVE), free)
                                  .order_by(batches.c.created_at).limit(8)):
                taken = db.execute(update(batches).where(batches.c.id == row.id, batches.c.status.in_(ACTIVE), free)
                                   .values(owner=replica, lease_until=now + lease_s)).rowcount
                if taken:
                    return dict(db.execute(select(batches).where(batches.c.id == row.id)).first()._mapping)
        return None

    def renew(self, batch_id: str, replica: str, now: float, lease_s: float) -> str | None:
        """The lease moved on; the batch's status, or None when another replica took it over."""
        with self.engine.begin() as db:
            held = db.execute(update(batches).where(batches.c.id == batch_id, batches.c.owner == replica)
                              .values(lease_until=now + lease_s)).rowcount
            return db.execute(select(batches.c.status).where(batches.c.id == batch_id)).scalar() if held else None

    def release(self, batch_id: str, replica: str) -> None:
        with self.engine.begin() as db:
            db.execute(update(batches).where(batches.c.id == batch_id, batches.c.owner == replica)
                       .values(owner=None, lease_until=None))

    def set_status(self, batch_id: str, status: str, now: float, **fields) -> None:
        with self.engine.begin() as db:
            db.execute(update(batches).where(batches.c.id == batch_id)
                       .values(status=status, **{f"{status}_at": now}, **fields))

    def done_lines(self, batch_id: str) -> set[int]:
        with self.engine.connect() as db:
            return set(db.execute(select(batch_results.c.line).where(batch_results.c.batch_id == batch_id)).scalars())

    def record(self, batch_id: str, line: int, ok: bool, text: str) -> bool:
        """A finished line (once: a second record of it changes nothing); False when it was there."""
        with self.engine.begin() as db:
            new = db.execute(self.upsert(batch_results).values(batch_id=batch_id, line=line, ok=int(ok), text=text)
                             .on_conflict_do_nothing(index_elements=["batch_id", "line"])
                             .returning(batch_results.c.line)).first() is not None     # (rowcount: -1 on some drivers)
            if new:
                counted = batches.c.completed if ok else batches.c.failed
                db.execute(update(batches).where(batches.c.id == batch_id).values({counted: counted + 1}))
            return bool(new)

    def results(self, batch_id: str) -> list[tuple[int, bool, str]]:
        with self.engine.connect() as db:
            rows = db.execute(select(batch_results.c.line, batch_results.c.ok, batch_results.c.text)
                              .where(batch_results.c.batch_id == batch_id).order_by(batch_results.c.line))
            return [(r.line, bool(r.ok), r.text) for r in rows]

    def finish(self, batch: dict, status: str, now: float, output: bytes, errors: bytes) -> None:
        """The batch's output and error files (when they have lines) and its last status, at once."""
        with self.engine.begin() as db:
            ids = {}
            for field, content in (("output_file_id", output), ("error_file_id", errors)):
                if content:
                    ids[field] = new_id("file-")
                    db.execute(insert(files).values(
                        id=ids[field], tenant=batch["tenant"], purpose="batch_output", content=content,
                        filename=f"{batch['id']}_{field.split('_')[0]}.jsonl", bytes=len(content), created_at=now))
                    # (the batch was let in under the tenant's limit: its results are kept past it)
                    storage_use.move(db, batch["tenant"], len(content))
            db.execute(update(batches).where(batches.c.id == batch["id"])
                       .values(status=status, **{f"{status}_at": now}, owner=None, lease_until=None, **ids))


def _owned(query, table, tenant: str | None, row_id: str):
    query = query.where(table.c.id == row_id)
    return query if tenant is None else query.where(table.c.tenant == tenant)


def errors_json(errors: list[dict]) -> str:
    return json.dumps({"object": "list", "data": errors})
