"""The `[store]` table: the tenant and billing database (services/store/) and what each tenant
may keep in it."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import NON_NEGATIVE, POSITIVE, Bounds, setting


@dataclass(slots=True)
class StoreConfig:
    """The tenant and billing database (services/store/)."""
    url: str = setting("", "the database: empty for SQLite in the cache folder, or postgresql://user@host/db")
    connect_timeout_s: float = setting(5.0, "PostgreSQL: opening a connection gives up after this long",
                                       bounds=Bounds(2, meaning="libpq's floor"))
    statement_timeout_s: float = setting(10.0, "PostgreSQL: the server cancels a statement after this long; "
                                         "the router stops waiting for any answer 1 s later", bounds=POSITIVE)
    refresh_s: float = setting(5.0, "the router re-reads keys, tenants and spending this often", bounds=POSITIVE)
    stale_s: float = setting(60.0, "tenants with limits or a budget are refused (UNAVAILABLE / 503) once the "
                             "router has not read the store for this long; tenants without are served",
                             bounds=POSITIVE, note="> refresh_s")
    tenant_storage_mb: int = setting(1024, "what a tenant may keep in the database (its files, kept responses and "
                                     "conversations), in MB, unless the tenant has its own (its --storage-mb, "
                                     "docs/tenants-and-billing.md); 0: no limit. Past it, uploads and "
                                     "requests that keep something are refused (429 storage_quota_exceeded)",
                                     bounds=NON_NEGATIVE)
