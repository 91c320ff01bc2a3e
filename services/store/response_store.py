"""Kept Responses API answers in the store (services/store/schema.py: responses). Synchronous
SQLAlchemy, called from a helper thread, as the rest of the store.

Every read, cancel and delete names its tenant (None: the admin's, any tenant): one tenant's
response is, to another, an id that does not exist. A response past its expiry is gone for every
reader at once (reads check the time); its row is deleted by the next purge.

A row holds its response's own input items and the id of the response it continued
(previous_response_id); the conversation's earlier items are read along that chain (one
recursive query), so each turn is stored once, not again in every later row (a chain of n turns
costs n rows' worth, not n^2). A deleted response's content is erased and its row kept as a link
until it expires: later responses list the items before and after it, not its own (OpenAI's
rule); an expired one ends the chain there.

A background response is written when it is queued and again as it runs, by the router replica
running it (its owner), which renews a lease on it. Its status changes only from queued or
in_progress, each change one conditional update: a cancel and the runner's last write cannot
both win. A reader that finds one whose lease lapsed (its router was lost) ends it as failed.
"""
from __future__ import annotations

import json

from sqlalchemy import delete, func, insert, literal, select, update

from services.store import storage_use
from services.store.schema import response_events, responses, row_id
from services.store.store import Store

ACTIVE = ("queued", "in_progress")
LOST = "the router running this background response stopped before it ended: send the request again"
# A background response's runs at most: its first, and a run again on another router each time
# the one running it was lost (a request that brings routers down is not tried for ever).
MAX_RUNS = 3


class ResponseStore:
    def __init__(self, store: Store):
        self.engine = store.engine

    def add(self, tenant: str, response: dict, input_items: list[dict], now: float, expires_at: float,
            owner: str | None = None, lease_until: float | None = None, request: dict | None = None) -> None:
        """Its tenant's storage limit was checked when the request came (services/control/
        storage_quota.py): the answer is made and billed, so it is kept even past the limit."""
        items_json, response_json = json.dumps(input_items), json.dumps(response)
        with self.engine.begin() as db:
            db.execute(insert(responses).values(
                id=response["id"], tenant=tenant, previous_id=response.get("previous_response_id"),
                status=response["status"], owner=owner, lease_until=lease_until, input_items=items_json,
                request=None if request is None else json.dumps(request),
                response=response_json, bytes=len(items_json) + len(response_json), created_at=now,
                expires_at=expires_at))
            storage_use.move(db, tenant, len(items_json) + len(response_json))

    def get(self, tenant: str | None, response_id: str, now: float) -> tuple[dict, list[dict]] | None:
        """(the response object, its input items: the earlier turns' then its own), or None:
        unknown, another tenant's, deleted or expired."""
        if not row_id(response_id):
            return None
        with self.engine.begin() as db:
            row = db.execute(_owned(select(responses), tenant, response_id, now)).first()
            if row is None:
                return None
            response = _as_now(db, row, now)
            earlier = _earlier_items(db, row.previous_id, now) if row.previous_id else []
        return response, earlier + json.loads(row.input_items)

    def current(self, response_id: str, now: float) -> dict | None:
        """The response object alone as it is now (a running one whose router was lost: failed),
        for a stream's reader (the caller has checked it is its tenant's); None: gone."""
        with self.engine.begin() as db:
            row = db.execute(_owned(select(responses.c.id, responses.c.status, responses.c.lease_until,
                                           responses.c.request, responses.c.response), None, response_id, now)).first()
            return None if row is None else _as_now(db, row, now)

    def update(self, response: dict, owner: str) -> bool:
        """The running response as it is now (its last write when its status is final); False when
        it was no longer running here (cancelled, or taken as lost)."""
        with self.engine.begin() as db:
            return _change(db, response["id"], response, responses.c.owner == owner)

    def adopt(self, owner: str, now: float, lease_s: float) -> dict | None:
        """A background response whose router was lost (its lease lapsed), claimed by `owner` to
        run it again: {id, tenant, created_at, request} with the request's runs counted, or None.
        One claim wins (a conditional update); one that has run MAX_RUNS times is not taken (a
        reader ends it failed)."""
        with self.engine.begin() as db:
            rows = db.execute(select(responses.c.id, responses.c.tenant, responses.c.created_at, responses.c.owner,
                                     responses.c.request)
                              .where(responses.c.status.in_(ACTIVE), responses.c.lease_until < now,
                                     responses.c.expires_at > now, responses.c.request.is_not(None))
                              .order_by(responses.c.created_at).limit(8)).all()
            for row in rows:
                request = json.loads(row.request)
                if request.get("runs", 1) >= MAX_RUNS:
                    continue
                request["runs"] = request.get("runs", 1) + 1
                if db.execute(update(responses).where(responses.c.id == row.id, responses.c.lease_until < now,
                                                      responses.c.status.in_(ACTIVE))
                              .values(owner=owner, lease_until=now + lease_s, request=json.dumps(request))).rowcount:
                    return {"id": row.id, "tenant": row.tenant, "created_at": row.created_at, "request": request}
        return None

    def cancel(self, tenant: str | None, response_id: str, now: float) -> tuple[dict, bool] | None:
        """(the response, whether this call cancelled it): a queued or running one ends cancelled;
        another is as it was. None: not found."""
        found = self.get(tenant, response_id, now)
        if found is None:
            return None
        response = found[0]
        if response["status"] not in ACTIVE:
            return response, False
        cancelled = _ended(response, "cancelled", None)
        with self.engine.begin() as db:
            if _change(db, response_id, cancelled):
                return cancelled, True
        return self.get(tenant, response_id, now)[0], False

    def renew(self, owner: str, response_ids: list[str], now: float, lease_s: float) -> dict[str, str]:
        """The leases of the responses this replica runs moved on; each one's status now."""
        if not response_ids:
            return {}
        with self.engine.begin() as db:
            db.execute(update(responses).where(responses.c.id.in_(response_ids), responses.c.owner == owner,
                                               responses.c.status.in_(ACTIVE)).values(lease_until=now + lease_s))
            rows = db.execute(select(responses.c.id, responses.c.status, responses.c.owner)
                              .where(responses.c.id.in_(response_ids)))
            # one another router took over (this one's lease had lapsed): "taken", to stop here
            return {row.id: row.status if row.owner in (owner, None) else "taken" for row in rows}

    def delete(self, tenant: str | None, response_id: str, now: float) -> bool:
        """Its content erased (its row stays, as a link of the chains through it, until it expires)."""
        if not row_id(response_id):
            return False
        with self.engine.begin() as db:
            # Marked first: the row is then held (and SQLite's database) until the commit, so the
            # size read next is the one this erases.
            if not db.execute(_owned(update(responses), tenant, response_id, now).values(
                    deleted=1, status="deleted", owner=None, lease_until=None)).rowcount:
                return False
            row = db.execute(select(responses.c.tenant, responses.c.bytes).where(responses.c.id == response_id)).one()
            db.execute(update(responses).where(responses.c.id == response_id).values(
                input_items="[]", response="{}", bytes=len("[]{}")))
            db.execute(delete(response_events).where(response_events.c.response_id == response_id))
            storage_use.move(db, row.tenant, len("[]{}") - row.bytes)
            return True

    # --- a background stream's events (services/router/openai_api/responses_stream.py) -----------

    def add_events(self, response_id: str, events: list[tuple[int, str]], now: float) -> None:
        """(sequence number, the event's JSON) rows of a running response's stream."""
        if events:
            with self.engine.begin() as db:
                db.execute(insert(response_events), [{"response_id": response_id, "seq": seq, "event": event,
                                                      "created_at": now} for seq, event in events])

    def events(self, response_id: str, after: int, limit: int = 1000) -> list[tuple[int, str]]:
        """The stream's events after sequence number `after`, in order (the caller has checked the
        response is its tenant's)."""
        with self.engine.connect() as db:
            rows = db.execute(select(response_events.c.seq, response_events.c.event)
                              .where(response_events.c.response_id == response_id, response_events.c.seq > after)
                              .order_by(response_events.c.seq).limit(limit))
            return [(row.seq, row.event) for row in rows]

    def last_event(self, response_id: str) -> tuple[int, str] | None:
        """(sequence number, type) of the stream's last event kept."""
        with self.engine.connect() as db:
            row = db.execute(select(response_events.c.seq, response_events.c.event)
                             .where(response_events.c.response_id == response_id)
                             .order_by(response_events.c.seq.desc()).limit(1)).first()
        return None if row is None else (row.seq, json.loads(row.event)["type"])

    def purge(self, now: float, events_before: float | None = None) -> int:
        """Delete the expired rows (and streams' events older than `events_before`); how many
        responses there were."""
        with self.engine.begin() as db:
            if events_before is not None:
                db.execute(delete(response_events).where(response_events.c.created_at < events_before))
            gone = db.execute(delete(responses).where(responses.c.expires_at <= now)
                              .returning(responses.c.tenant, responses.c.bytes)).all()
            freed: dict[str, int] = {}
            for row in gone:
                freed[row.tenant] = freed.get(row.tenant, 0) - row.bytes
            storage_use.move_each(db, freed)
            return len(gone)


def _owned(query, tenant: str | None, response_id: str, now: float):
    query = query.where(responses.c.id == response_id, responses.c.expires_at > now, responses.c.deleted == 0)
    return query if tenant is None else query.where(responses.c.tenant == tenant)


def _as_now(db, row, now: float) -> dict:
    """A row's response; a queued or running one whose lease lapsed (its router was lost) ends
    failed, by the first reader that sees it, unless another router will run it again (adopt())."""
    response = json.loads(row.response)
    if row.status in ACTIVE and (row.lease_until or 0.0) < now and not _adoptable(row.request):
        lost = _ended(response, "failed", {"code": "server_error", "message": LOST})
        if _change(db, row.id, lost, responses.c.lease_until < now):
            return lost
        # it changed meanwhile: as it is now
        return json.loads(db.execute(select(responses.c.response).where(responses.c.id == row.id)).scalar())
    return response


def _adoptable(request: str | None) -> bool:
    return request is not None and json.loads(request).get("runs", 1) < MAX_RUNS


def _earlier_items(db, previous_id: str, now: float) -> list[dict]:
    """The items a response continuing `previous_id` follows: each earlier response's own input
    items and its output, oldest first; a deleted one's left out, an expired one ends the chain."""
    older = responses.alias("older")
    chain = select(responses.c.id, responses.c.previous_id, responses.c.input_items, responses.c.response,
                   responses.c.deleted, literal(0).label("depth")) \
        .where(responses.c.id == previous_id, responses.c.expires_at > now).cte("chain", recursive=True)
    chain = chain.union_all(select(older.c.id, older.c.previous_id, older.c.input_items, older.c.response,
                                   older.c.deleted, chain.c.depth + 1)
                            .where(older.c.id == chain.c.previous_id, older.c.expires_at > now))
    items: list[dict] = []
    for row in db.execute(select(chain).order_by(chain.c.depth.desc())):
        if not row.deleted:
            items += json.loads(row.input_items)
            items += json.loads(row.response).get("output") or []
    return items


def _ended(response: dict, status: str, error: dict | None) -> dict:
    return {**response, "status": status, "error": error}


def _change(db, response_id: str, response: dict, *conditions) -> bool:
    """The row's response and status, if it is still queued or running (and `conditions` hold);
    a final status lets go of the lease."""
    values = {"status": response["status"], "response": json.dumps(response)}
    if response["status"] not in ACTIVE:
        values.update(owner=None, lease_until=None)
    if not db.execute(update(responses).where(responses.c.id == response_id, responses.c.status.in_(ACTIVE),
                                              *conditions).values(**values)).rowcount:
        return False
    # Written first, so held until the commit: the size read here is the one replaced.
    row = db.execute(select(responses.c.tenant, responses.c.bytes, func.length(responses.c.input_items).label("items"))
                     .where(responses.c.id == response_id)).one()
    size = row.items + len(values["response"])
    db.execute(update(responses).where(responses.c.id == response_id).values(bytes=size))
    storage_use.move(db, row.tenant, size - row.bytes)
    return True
