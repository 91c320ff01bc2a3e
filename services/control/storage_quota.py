"""Each tenant's limit on what it keeps in the store (files, kept responses, conversations), and
how the routers hold it (the totals: services/store/storage_use.py).

- A write whose size is known before it is made (a file upload, a conversation created or given
  items or metadata) is checked in its own transaction: it fits or nothing is written.
- What a request will keep is known only once it ends (a kept response, the turns it adds to a
  conversation, a batch's output file): such a request is let in while the tenant was under its
  limit at the router's last read of the totals ([store] refresh_s ago at most), and what it
  keeps is kept even past it; the next one after the read is refused. A tenant may so go over its
  limit by what it keeps in one refresh_s.
The refusal is 429 `storage_quota_exceeded`, without Retry-After: room comes back by deleting
(files, kept responses, conversations), as kept responses expire, or when the admin raises the
limit, not by waiting a known time.
"""
from __future__ import annotations

from services.common.errors import ErrorKind, ServiceError
from services.control.tenancy import Caller, TenantBook
from services.store import storage_use
from services.store.store import Tenant

MB = 1_000_000


def storage_limit(caller: Caller, default_mb: int) -> int | None:
    """The caller's limit in bytes (the admin key has none)."""
    return None if caller.admin else limit_of(caller.tenant, default_mb)


def limit_of(tenant: Tenant | None, default_mb: int) -> int | None:
    """A tenant's limit in bytes: its own (storage_mb), else the cluster's default ([store]
    tenant_storage_mb; 0: none). None: no limit."""
    own = tenant.storage_mb if tenant is not None else None
    if own is not None:
        return own * MB
    return default_mb * MB if default_mb else None


def storage_refusal(full: storage_use.StorageFull, field: str) -> ServiceError:
    needs = f" and this needs {full.adding / MB:.3f} MB more" if full.adding else ""
    return ServiceError(
        ErrorKind.EXHAUSTED,
        f"tenant {full.tenant} keeps {full.used / MB:.3f} MB of its {full.limit / MB:g} MB of storage (files, kept "
        f"responses, conversations){needs}: delete files, responses or conversations it no longer needs (kept "
        f"responses also expire), send store false, or have the admin raise it (`qos-serve tenants set "
        f"{full.tenant} --storage-mb N`)", field=field, reason="storage_quota_exceeded")


def require_room(book: TenantBook, caller: Caller, field: str) -> None:
    """For a request that will keep what it makes: let in while its tenant is under its limit, by
    the totals the router read with keys and tenants (every [store] refresh_s; no database read on
    the request's path). While the store does not answer, that copy stands (what a request would
    keep cannot be written then either: its answer goes out unkept)."""
    limit = storage_limit(caller, book.storage_mb)
    used = book.stored.get(caller.name, 0)
    if limit is not None and used >= limit:
        raise storage_refusal(storage_use.StorageFull(caller.name, used, 0, limit), field)
