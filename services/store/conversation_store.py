"""OpenAI's Conversations API in the store (services/store/schema.py: conversations,
conversation_items). Synchronous SQLAlchemy, called from a helper thread, as the rest of the store.

Every read and write names its tenant (None: the admin's, any tenant): one tenant's
conversation is, to another, an id that does not exist. Items are appended in one transaction
at the positions after the last; two appends at once (two responses of one conversation ending
together) meet on the position's key and the later one tries again after the other.
"""
from __future__ import annotations

import json

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from services.store import storage_use
from services.store.schema import conversation_items, conversations, row_id
from services.store.store import Store

APPEND_TRIES = 5


class ConversationStore:
    def __init__(self, store: Store):
        self.engine = store.engine

    def create(self, conversation_id: str, tenant: str, meta: dict | None, items: list[dict], now: float,
               limit: int | None = None) -> dict:
        """Raises StorageFull (nothing written) when it would take the tenant past `limit` bytes."""
        meta_json = json.dumps(meta or {})
        with self.engine.begin() as db:
            db.execute(insert(conversations).values(id=conversation_id, tenant=tenant, meta=meta_json,
                                                    bytes=len(meta_json), created_at=now))
            size = self._insert(db, conversation_id, 0, items)
            storage_use.move(db, tenant, len(meta_json) + size, limit)
        return self.get(tenant, conversation_id)

    def get(self, tenant: str | None, conversation_id: str) -> dict | None:
        if not row_id(conversation_id):
            return None
        with self.engine.connect() as db:
            row = db.execute(_owned(select(conversations), tenant, conversation_id)).first()
        return None if row is None else {"id": row.id, "object": "conversation", "created_at": int(row.created_at),
                                         "metadata": json.loads(row.meta or "{}"), "tenant": row.tenant}

    def set_metadata(self, tenant: str | None, conversation_id: str, meta: dict,
                     limit: int | None = None) -> dict | None:
        if not row_id(conversation_id):
            return None
        meta_json = json.dumps(meta)
        with self.engine.begin() as db:
            # Held first (a write), so the size read next is the one replaced.
            if not db.execute(_owned(update(conversations), tenant, conversation_id)
                              .values(bytes=conversations.c.bytes)).rowcount:
                return None
            row = db.execute(select(conversations.c.tenant, conversations.c.bytes)
                             .where(conversations.c.id == conversation_id)).one()
            db.execute(update(conversations).where(conversations.c.id == conversation_id)
                       .values(meta=meta_json, bytes=len(meta_json)))
            storage_use.move(db, row.tenant, len(meta_json) - row.bytes, limit)
        return self.get(tenant, conversation_id)

    def delete(self, tenant: str | None, conversation_id: str) -> bool:
        if not row_id(conversation_id):
            return False
        with self.engine.begin() as db:
            gone = db.execute(_owned(delete(conversations), tenant, conversation_id)
                              .returning(conversations.c.tenant, conversations.c.bytes)).first()
            if gone is None:
                return False
            items = db.execute(delete(conversation_items).where(conversation_items.c.conversation_id == conversation_id)
                               .returning(conversation_items.c.bytes)).all()
            storage_use.move(db, gone.tenant, -gone.bytes - sum(item.bytes for item in items))
            return True

    def append(self, tenant: str | None, conversation_id: str, items: list[dict], limit: int | None = None) -> bool:
        """The items after the conversation's last; False when it is gone (deleted, not the tenant's).
        Raises StorageFull (nothing written) when they would take the tenant past `limit` bytes."""
        for attempt in range(APPEND_TRIES):
            try:
                with self.engine.begin() as db:
                    # Held first (a write): a delete of the conversation waits for these items and
                    # takes them too, or goes first and this finds nothing (no item outlives it).
                    if not db.execute(_owned(update(conversations), tenant, conversation_id)
                                      .values(bytes=conversations.c.bytes)).rowcount:
                        return False
                    owner = db.execute(select(conversations.c.tenant)
                                       .where(conversations.c.id == conversation_id)).scalar()
                    last = db.execute(select(func.max(conversation_items.c.position))
                                      .where(conversation_items.c.conversation_id == conversation_id)).scalar()
                    size = self._insert(db, conversation_id, 0 if last is None else last + 1, items)
                    storage_use.move(db, owner, size, limit)
                return True
            except IntegrityError:          # another append took these positions first: after it, then
                if attempt == APPEND_TRIES - 1:
                    raise
        return False

    def items(self, conversation_id: str) -> list[dict]:
        """Every item, in order (the caller has checked the conversation is its own)."""
        with self.engine.connect() as db:
            rows = db.execute(select(conversation_items.c.item).where(conversation_items.c.conversation_id
                                                                      == conversation_id)
                              .order_by(conversation_items.c.position))
            return [json.loads(row.item) for row in rows]

    def items_page(self, conversation_id: str, limit: int, order: str, after: str | None) -> tuple[list[dict], bool]:
        """OpenAI's page of its items (item_pages.py's, read by the database: a long conversation
        is not read whole for each page): up to `limit` in `order` ("asc" or "desc") after the
        item `after` (an id not in it: none), and whether more follow."""
        position = conversation_items.c.position
        query = select(conversation_items.c.item).where(conversation_items.c.conversation_id == conversation_id)
        with self.engine.connect() as db:
            if after is not None:
                start = db.execute(select(position).where(conversation_items.c.conversation_id == conversation_id,
                                                          conversation_items.c.item_id == after)
                                   .order_by(position if order == "asc" else position.desc())).scalar() \
                    if row_id(after) else None
                if start is None:
                    return [], False
                query = query.where(position > start if order == "asc" else position < start)
            rows = db.execute(query.order_by(position if order == "asc" else position.desc()).limit(limit + 1)).all()
        return [json.loads(row.item) for row in rows[:limit]], len(rows) > limit

    def item(self, conversation_id: str, item_id: str) -> dict | None:
        """One item (the caller has checked the conversation is its own)."""
        if not row_id(item_id):
            return None
        with self.engine.connect() as db:
            found = db.execute(select(conversation_items.c.item).where(
                conversation_items.c.conversation_id == conversation_id,
                conversation_items.c.item_id == item_id).order_by(conversation_items.c.position)).first()
        return None if found is None else json.loads(found.item)

    def delete_item(self, conversation_id: str, item_id: str) -> bool:
        if not row_id(item_id):
            return False
        with self.engine.begin() as db:
            gone = db.execute(delete(conversation_items).where(conversation_items.c.conversation_id == conversation_id,
                                                               conversation_items.c.item_id == item_id)
                              .returning(conversation_items.c.bytes)).all()
            if gone:
                owner = db.execute(select(conversations.c.tenant).where(conversations.c.id == conversation_id)).scalar()
                storage_use.move(db, owner, -sum(item.bytes for item in gone))
            return bool(gone)

    @staticmethod
    def _insert(db, conversation_id: str, start: int, items: list[dict]) -> int:
        """The items written from position `start`; their bytes."""
        rows = [{"conversation_id": conversation_id, "position": start + k, "item_id": item["id"],
                 "item": json.dumps(item)} for k, item in enumerate(items)]
        for row in rows:
            row["bytes"] = len(row["item"])
        if rows:
            db.execute(insert(conversation_items), rows)
        return sum(row["bytes"] for row in rows)


def _owned(query, tenant: str | None, conversation_id: str):
    query = query.where(conversations.c.id == conversation_id)
    return query if tenant is None else query.where(conversations.c.tenant == tenant)
