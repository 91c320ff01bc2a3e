"""The tenant and billing store: SQLite by default (a file in the cache folder, WAL mode, so the
router and the `qos-serve tenants|keys|billing` commands can use it at once), PostgreSQL by URL.

Synchronous SQLAlchemy: the router calls it from a helper thread, never on its event loop.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import delete, func, insert, inspect, select, update
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError

from services.common.paths import cache_root
from services.common.priority import ADMIN_TENANT, LABELS
from services.store import storage_use
from services.store.connect import CONNECT_TIMEOUT_S, STATEMENT_TIMEOUT_S, make_engine, upsert_for
from services.store.schema import (
    ADDED_COLUMNS,
    MIGRATIONS,
    SCHEMA_VERSION,
    TENANT_NAME_MAX,
    api_keys,
    ledger,
    limit_shares,
    metadata,
    schema_info,
    tenant_spend,
    tenant_storage,
    tenants,
)

STORAGE_TOTALS_SCHEMA = 6          # the upgrade that started tenant_storage sums the rows there

KEY_PREFIX = "qsk_"
PREFIX_CHARS = 12           # what is stored and shown of a key: "qsk_" + 8 characters
ALL_PRIORITIES = LABELS
STORAGE_MB_MAX = 2**31 - 1          # the column's range (an INTEGER on both databases)


class StoreError(ValueError):
    """A store operation that cannot be done; the message says why (names the tenant, key...)."""


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    priorities: tuple[str, ...] = ALL_PRIORITIES
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    budget: float | None = None
    weight: float = 1.0
    storage_mb: int | None = None        # what it may keep in the store; None: [store] tenant_storage_mb


STORE_URL_ENV = "QOS_STORE_URL"
PREPARE_LOCK = 0x51_05_5E_54       # PostgreSQL advisory lock held while a process prepares the schema


def default_url() -> str:
    """$QOS_STORE_URL, else SQLite in the cache folder."""
    return os.environ.get(STORE_URL_ENV) or f"sqlite:///{cache_root() / 'qos-serve.db'}"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _tenant(row) -> Tenant:
    return Tenant(row.name, tuple(p for p in row.priorities.split(",") if p), row.rpm, row.tpm,
                  row.max_concurrent, row.budget, row.weight, row.storage_mb)


def check_tenant_fields(priorities=None, rpm=None, tpm=None, max_concurrent=None, budget=None,
                        weight=None, storage_mb=None) -> None:
    if priorities is not None:
        unknown = [p for p in priorities if p not in ALL_PRIORITIES]
        if unknown or not priorities:
            raise StoreError(f"priorities must be some of high, medium, low, got {','.join(priorities)!r}")
    for name, value in (("rpm", rpm), ("tpm", tpm), ("max_concurrent", max_concurrent)):
        if value is not None and value < 1:
            raise StoreError(f"{name} must be >= 1, got {value}")
    if budget is not None and budget < 0:
        raise StoreError(f"budget must be >= 0, got {budget}")
    if weight is not None and not weight > 0:
        raise StoreError(f"weight must be > 0, got {weight}")
    if storage_mb is not None and not 0 <= storage_mb <= STORAGE_MB_MAX:
        raise StoreError(f"storage_mb must be 0-{STORAGE_MB_MAX}, got {storage_mb}")


def refused_for_its_data(error: Exception) -> bool:
    """The database refused the rows themselves (a value too long, a constraint), not the
    connection or the schema: the same rows would be refused again, the others would not."""
    if isinstance(error, DBAPIError):
        return isinstance(error, (DataError, IntegrityError)) and not error.connection_invalidated
    return isinstance(error, StatementError)        # a value that could not be bound at all


class Store:
    def __init__(self, url: str | None = None, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 statement_timeout_s: float = STATEMENT_TIMEOUT_S):
        self.url = url or default_url()
        self.engine = make_engine(self.url, connect_timeout_s, statement_timeout_s)
        self._prepare()

    def close(self) -> None:
        self.engine.dispose()

    @contextlib.contextmanager
    def _preparing(self):
        """SQLite: an exclusive lock on a file beside the database while one process prepares it."""
        path = self.url.removeprefix("sqlite:///") if self.url.startswith("sqlite:///") else ""
        if path in ("", ":memory:"):
            yield
            return
        with open(Path(path).expanduser().with_name(Path(path).name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _prepare(self) -> None:
        """Create a new database, upgrade an older one, refuse a newer one. Router replicas start
        together: one prepares while the others wait (checking for a table and creating it are
        two statements, so two at once could both try to create it)."""
        with self._preparing(), self.engine.begin() as db:
            if self.engine.dialect.name == "postgresql":
                db.exec_driver_sql(f"SELECT pg_advisory_xact_lock({PREPARE_LOCK})")
            metadata.create_all(db)
            version = db.execute(select(schema_info.c.version)).scalar()
            if version is None:
                db.execute(insert(schema_info).values(id=1, version=SCHEMA_VERSION))
                return
            if version > SCHEMA_VERSION:
                raise StoreError(f"the database at {self.url} has schema version {version}, newer than "
                                 f"this qos-serve knows ({SCHEMA_VERSION}); upgrade qos-serve")
            for step in range(version + 1, SCHEMA_VERSION + 1):
                for table, column, kind in ADDED_COLUMNS.get(step, []):
                    if column not in {c["name"] for c in inspect(db).get_columns(table)}:
                        db.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                for statement in MIGRATIONS.get(step, []):
                    db.exec_driver_sql(statement)
                if step == STORAGE_TOTALS_SCHEMA:
                    storage_use.recount(db)
            db.execute(update(schema_info).values(version=SCHEMA_VERSION))

    # --- tenants ---------------------------------------------------------------------------------

    def add_tenant(self, tenant: Tenant) -> Tenant:
        if not tenant.name or len(tenant.name) > TENANT_NAME_MAX or not tenant.name.isprintable():
            raise StoreError(f"tenant names are 1-{TENANT_NAME_MAX} printable characters, got {tenant.name!r}")
        if tenant.name == ADMIN_TENANT:
            raise StoreError(f"the tenant name {ADMIN_TENANT!r} is reserved: the admin key's requests are "
                             "billed under it")
        check_tenant_fields(tenant.priorities, tenant.rpm, tenant.tpm, tenant.max_concurrent,
                            tenant.budget, tenant.weight, tenant.storage_mb)
        try:
            with self.engine.begin() as db:
                db.execute(insert(tenants).values(
                    name=tenant.name, priorities=",".join(tenant.priorities), rpm=tenant.rpm,
                    tpm=tenant.tpm, max_concurrent=tenant.max_concurrent, budget=tenant.budget,
                    weight=tenant.weight, storage_mb=tenant.storage_mb, created_at=time.time()))
        except IntegrityError:
            raise StoreError(f"tenant {tenant.name!r} exists already") from None
        return tenant

    def set_tenant(self, name: str, **changes) -> Tenant:
        """Change some fields; a value of None leaves that field as it is, except with
        clear=[field, ...], which sets those fields back to no limit."""
        clear = changes.pop("clear", ())
        changes = {k: v for k, v in changes.items() if v is not None}
        check_tenant_fields(**changes)
        if "priorities" in changes:
            changes["priorities"] = ",".join(changes["priorities"])
        changes.update({field: None for field in clear})
        with self.engine.begin() as db:
            if not db.execute(update(tenants).where(tenants.c.name == name).values(**changes)).rowcount:
                raise StoreError(f"no tenant named {name!r}")
        return self.tenant(name)

    def tenant(self, name: str) -> Tenant:
        with self.engine.connect() as db:
            row = db.execute(select(tenants).where(tenants.c.name == name)).first()
        if row is None:
            raise StoreError(f"no tenant named {name!r}")
        return _tenant(row)

    def tenants(self) -> list[Tenant]:
        with self.engine.connect() as db:
            return [_tenant(r) for r in db.execute(select(tenants).order_by(tenants.c.name))]

    # --- keys ------------------------------------------------------------------------------------

    def create_key(self, tenant_name: str) -> tuple[str, str]:
        """A new key for the tenant: (the key, shown this once; its display prefix)."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        with self.engine.begin() as db:
            tenant_id = db.execute(select(tenants.c.id).where(tenants.c.name == tenant_name)).scalar()
            if tenant_id is None:
                raise StoreError(f"no tenant named {tenant_name!r}")
            db.execute(insert(api_keys).values(tenant_id=tenant_id, prefix=key[:PREFIX_CHARS],
                                               key_hash=hash_key(key), created_at=time.time()))
        return key, key[:PREFIX_CHARS]

    def revoke_key(self, prefix: str) -> str:
        """Revoke the key with this prefix; returns its tenant's name."""
        with self.engine.begin() as db:
            row = db.execute(select(api_keys.c.id, api_keys.c.revoked_at, tenants.c.name)
                             .join(tenants).where(api_keys.c.prefix == prefix)).first()
            if row is None:
                raise StoreError(f"no key with prefix {prefix!r}")
            if row.revoked_at is None:
                db.execute(update(api_keys).where(api_keys.c.id == row.id).values(revoked_at=time.time()))
        return row.name

    def keys(self) -> list[tuple[str, str, float, float | None]]:
        """(prefix, tenant, created_at, revoked_at) of every key."""
        with self.engine.connect() as db:
            return [tuple(r) for r in db.execute(
                select(api_keys.c.prefix, tenants.c.name, api_keys.c.created_at, api_keys.c.revoked_at)
                .join(tenants).order_by(tenants.c.name, api_keys.c.created_at))]

    def active_keys(self) -> dict[str, tuple[str, str]]:
        """key hash -> (tenant, prefix), for every key not revoked (the router's cache)."""
        with self.engine.connect() as db:
            return {r.key_hash: (r.name, r.prefix) for r in db.execute(
                select(api_keys.c.key_hash, api_keys.c.prefix, tenants.c.name).join(tenants)
                .where(api_keys.c.revoked_at.is_(None)))}

    def snapshot(self) -> tuple[dict[str, tuple[str, str]], list[Tenant], dict[str, float], dict[str, int]]:
        """What the router caches, read in one transaction: (active_keys(), tenants(), spent(), the
        bytes each tenant keeps in the store (services/store/storage_use.py))."""
        with self.engine.begin() as db:
            keys = {r.key_hash: (r.name, r.prefix) for r in db.execute(
                select(api_keys.c.key_hash, api_keys.c.prefix, tenants.c.name).join(tenants)
                .where(api_keys.c.revoked_at.is_(None)))}
            return (keys, [_tenant(r) for r in db.execute(select(tenants).order_by(tenants.c.name))],
                    {r.tenant: r.amount for r in db.execute(select(tenant_spend))},
                    {r.tenant: r.bytes for r in db.execute(select(tenant_storage).where(tenant_storage.c.bytes > 0))})

    # --- the ledger ------------------------------------------------------------------------------

    def _upsert(self):
        return upsert_for(self.engine.dialect.name)

    def write_ledger(self, rows: list[dict]) -> int:
        """Insert rows; a request id already there is skipped (never two rows for one request).
        Each tenant's running total moves in the same transaction. Returns how many were new."""
        if not rows:
            return 0
        upsert = self._upsert()
        statement = upsert(ledger).on_conflict_do_nothing(index_elements=["request_id"]) \
            .returning(ledger.c.tenant, ledger.c.amount)     # rowcount of a batch is not reliable everywhere
        with self.engine.begin() as db:
            new = db.execute(statement, rows).all()
            added: dict[str, float] = {}
            for row in new:
                added[row.tenant] = added.get(row.tenant, 0.0) + row.amount
            for tenant, amount in sorted(added.items()):    # one order: two writers never deadlock
                total = upsert(tenant_spend).values(tenant=tenant, amount=amount)
                db.execute(total.on_conflict_do_update(index_elements=["tenant"],
                                                       set_={"amount": tenant_spend.c.amount + amount}))
            return len(new)

    def spent(self) -> dict[str, float]:
        """Cost units each tenant has spent, all time."""
        with self.engine.connect() as db:
            return {r.tenant: r.amount for r in db.execute(select(tenant_spend))}

    # --- router replicas' shares of the limits (services/control/limit_shares.py) ------------------

    def exchange_shares(self, replica: str, forget_before: float, decide) -> dict[str, float]:
        """One transaction, holding the shares table against other replicas: drop rows silent since
        `forget_before`, hand the other replicas' rows to `decide`, store the rows it returns as
        this replica's. Returns what each tenant has spent (read in the same visit)."""
        with self.engine.begin() as db:
            if self.engine.dialect.name == "postgresql":
                db.exec_driver_sql("LOCK TABLE limit_shares IN EXCLUSIVE MODE")
            # On SQLite this first write takes the database's write lock for the whole transaction.
            db.execute(delete(limit_shares).where(limit_shares.c.heartbeat < forget_before))
            others = [dict(r._mapping) for r in db.execute(
                select(limit_shares).where(limit_shares.c.replica != replica))]
            mine = decide(others)
            db.execute(delete(limit_shares).where(limit_shares.c.replica == replica))
            if mine:
                db.execute(insert(limit_shares), mine)
            return {r.tenant: r.amount for r in db.execute(select(tenant_spend))}

    def release_shares(self, replica: str) -> None:
        """A replica stopping cleanly: its shares go back to the others at once."""
        with self.engine.begin() as db:
            db.execute(delete(limit_shares).where(limit_shares.c.replica == replica))

    def usage_lines(self, tenant: str | None = None, since: float | None = None) -> list[dict]:
        """Ledger totals by (tenant, priority), summed by the database (sorted here: collations
        differ between databases)."""
        query = select(ledger.c.tenant, ledger.c.priority, func.count().label("requests"),
                       func.sum(ledger.c.prompt_tokens).label("prompt_tokens"),
                       func.sum(ledger.c.completion_tokens).label("completion_tokens"),
                       func.sum(ledger.c.amount).label("amount")) \
            .group_by(ledger.c.tenant, ledger.c.priority)
        if tenant is not None:
            query = query.where(ledger.c.tenant == tenant)
        if since is not None:
            query = query.where(ledger.c.finished_at >= since)
        with self.engine.connect() as db:
            rows = db.execute(query).all()
        return [{"tenant": r.tenant, "priority": r.priority, "requests": int(r.requests),
                 "prompt_tokens": int(r.prompt_tokens), "completion_tokens": int(r.completion_tokens),
                 "amount": float(r.amount)} for r in sorted(rows, key=lambda r: (r.tenant, r.priority))]

    def ledger_rows(self, tenant: str | None = None, since: float | None = None,
                    request_id: str | None = None) -> list[dict]:
        query = select(ledger).order_by(ledger.c.finished_at)
        if request_id is not None:
            query = query.where(ledger.c.request_id == request_id)
        if tenant is not None:
            query = query.where(ledger.c.tenant == tenant)
        if since is not None:
            query = query.where(ledger.c.finished_at >= since)
        with self.engine.connect() as db:
            return [dict(r._mapping) for r in db.execute(query)]
