"""Kept Responses API answers in the store (services/store/schema.py: responses). Synchronous
SQLAlchemy, called from a helper thread, as the rest of the store.

Every read and delete names its tenant (None: the admin's, any tenant): one tenant's response
is, to another, an id that does not exist. A response past its expiry is gone for every reader
at once (reads check the time); its row is deleted by the next purge.
"""
from __future__ import annotations

import json

from sqlalchemy import delete, insert, select

from services.store.schema import responses
from services.store.store import Store


class ResponseStore:
    def __init__(self, store: Store):
        self.engine = store.engine

    def add(self, tenant: str, response: dict, input_items: list[dict], now: float, expires_at: float) -> None:
        with self.engine.begin() as db:
            db.execute(insert(responses).values(
                id=response["id"], tenant=tenant, previous_id=response.get("previous_response_id"),
                input_items=json.dumps(input_items), response=json.dumps(response), created_at=now,
                expires_at=expires_at))

    def get(self, tenant: str | None, response_id: str, now: float) -> tuple[dict, list[dict]] | None:
        """(the response object, its input items), or None: unknown, another tenant's or expired."""
        query = select(responses.c.response, responses.c.input_items).where(
            responses.c.id == response_id, responses.c.expires_at > now)
        if tenant is not None:
            query = query.where(responses.c.tenant == tenant)
        with self.engine.connect() as db:
            row = db.execute(query).first()
        return (json.loads(row.response), json.loads(row.input_items)) if row else None

    def delete(self, tenant: str | None, response_id: str, now: float) -> bool:
        query = delete(responses).where(responses.c.id == response_id, responses.c.expires_at > now)
        if tenant is not None:
            query = query.where(responses.c.tenant == tenant)
        with self.engine.begin() as db:
            return db.execute(query).rowcount > 0

    def purge(self, now: float) -> int:
        """Delete the expired rows; how many there were."""
        with self.engine.begin() as db:
            return db.execute(delete(responses).where(responses.c.expires_at <= now)).rowcount
