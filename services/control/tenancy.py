"""Who is calling, and the gate every request passes at the router before it is routed:
authentication (API key -> tenant), entitlements and limits (services/control/limits.py), and,
when it ends, its line in the billing ledger (services/control/ledger.py).

The router never queries the database on the request path: keys, tenants and what each tenant
has spent are cached here and re-read from the store every [store] refresh_s (in a helper thread),
so `qos-serve tenants|keys` changes apply within that time. Without the store the cache goes on
serving; after [store] stale_s tenants with limits or a budget are refused (keep_fresh()). With
[auth] replicas above 1, the replicas also exchange their shares of the limits, and what each
tenant spent, every SYNC_S (services/control/limit_shares.py).

    [auth] required = false   a request without a known key is the `anonymous` tenant (or the
                              tenant its x-tenant header names), with that tenant's limits if it
                              exists; a known key is its tenant
    [auth] required = true    no key, or an unknown or revoked one -> UNAUTHENTICATED / 401
    admin key                 ([auth] admin_key or $QOS_ADMIN_KEY) sees every tenant's usage
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass

from prometheus_client.core import GaugeMetricFamily

from services.common.errors import ErrorKind, ServiceError, invalid, unavailable
from services.common.priority import ADMIN_TENANT, TENANT_HEADER, parse_tenant, priority_name
from services.control.limit_shares import FORGET_S, KINDS, SYNC_S, SharedLimits, ShareRow
from services.control.limits import Limiter, Reservation
from services.store.store import Store, Tenant, hash_key

log = logging.getLogger(__name__)

REFRESH_S = 5.0
STALE_S = 60.0              # without the store this long, limited and budgeted tenants are refused
ANONYMOUS = "anonymous"
ADMIN_KEY_ENV = "QOS_ADMIN_KEY"


@dataclass(slots=True, frozen=True)
class Caller:
    tenant: Tenant
    key_prefix: str = ""
    admin: bool = False

    @property
    def name(self) -> str:
        return self.tenant.name

    @property
    def scope(self) -> str | None:
        """The tenant whose stored objects it reads (files, batches, kept responses,
        conversations); None: the admin's, every tenant's."""
        return None if self.admin else self.name


@dataclass(slots=True)
class Pass:
    """A request let through the gate: whom to bill, and what it reserved."""
    caller: Caller
    reservation: Reservation | None = None


def limited(tenant: Tenant) -> bool:
    return any(v is not None for v in (tenant.rpm, tenant.tpm, tenant.max_concurrent, tenant.budget))


def bearer(authorization: str | None) -> str | None:
    """The key from an `authorization: Bearer <key>` header (None when absent)."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ServiceError(ErrorKind.UNAUTHENTICATED, "authorization must be 'Bearer <API key>'",
                           field="authorization", reason="bad_credentials")
    key = key.strip()
    if not (key.isascii() and key.isprintable()):     # no key of ours (hmac.compare_digest raises)
        odd = next(i for i, c in enumerate(key) if not (c.isascii() and c.isprintable()))
        raise ServiceError(ErrorKind.UNAUTHENTICATED, f"the API key has a character that is not printable "
                           f"ASCII at offset {odd}: keys are 'qsk_' and URL-safe characters",
                           field="authorization", reason="bad_credentials")
    return key


class TenantBook:
    def __init__(self, store: Store, required: bool = False, admin_key: str = "", replicas: int = 1,
                 refresh_s: float = REFRESH_S, stale_s: float = STALE_S, storage_mb: int = 0):
        self.store = store
        self.storage_mb = storage_mb          # [store] tenant_storage_mb (services/control/storage_quota.py)
        self.required = required
        self.admin_key = admin_key or os.environ.get(ADMIN_KEY_ENV, "")
        self.replica = f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(3)}"
        self.limiter = Limiter(SharedLimits(self.replica) if replicas > 1 else None)
        self.keys: dict[str, tuple[str, str]] = {}      # key hash -> (tenant, prefix)
        self.tenants: dict[str, Tenant] = {}
        self.spent: dict[str, float] = {}
        self.stored: dict[str, int] = {}        # bytes each tenant keeps in the store, as last read
        self.loaded = asyncio.Event()
        self.refresh_s, self.stale_s = refresh_s, stale_s
        self.read_at = time.monotonic()         # the cache's last successful read of the store
        self.refresh_failures = 0

    async def refresh(self) -> None:
        """Re-read keys, tenants and spending (in a helper thread, bounded by the store's timeouts:
        services/store/connect.py)."""
        keys, tenants, spent, self.stored = await asyncio.to_thread(self.store.snapshot)
        self.keys, self.tenants = keys, {t.name: t for t in tenants}
        self._merge_spent(spent)
        self.read_at = time.monotonic()
        self.loaded.set()

    def _merge_spent(self, spent: dict[str, float]) -> None:
        """What the store says each tenant spent, or more where this router added rows the ledger
        has not written yet (it writes in batches). Only budgets read it: tenants without one are
        not kept (the store holds every tenant ever billed; with auth off any x-tenant is one)."""
        mine = self.spent
        self.spent = {name: max(spent.get(name, 0.0), mine.get(name, 0.0))
                      for name, tenant in self.tenants.items()
                      if tenant.budget is not None and (name in spent or name in mine)}

    async def keep_fresh(self) -> None:
        """Refresh every refresh_s. While the store cannot be read the cache is kept (revoked keys
        still pass, as they did), tenants with limits or a budget are refused after stale_s
        (admit()), and the outage is logged when it starts and when it ends."""
        while True:
            try:
                await self.refresh()
                if self.refresh_failures:
                    log.warning("tenant store %s reachable again after %d failed refreshes; keys and "
                                "revocations are current", self.store.url, self.refresh_failures)
                self.refresh_failures = 0
            except Exception as exc:
                if not self.refresh_failures:
                    log.error("tenant store %s: %s; serving from the cache, tenants with limits or a "
                              "budget are refused if this lasts %.0f s", self.store.url, exc, self.stale_s)
                self.refresh_failures += 1
            await asyncio.sleep(self.refresh_s)

    def stale_for(self, now: float) -> float:
        """Seconds the cache has gone unrefreshed beyond stale_s (0: fresh enough)."""
        return max(0.0, now - self.read_at - self.stale_s)

    @property
    def shared(self) -> bool:
        return self.limiter.shares is not None

    def _exchange(self) -> None:
        """One exchange of this replica's limit shares with the others (in a helper thread)."""
        shares = self.limiter.shares
        limits = {(t.name, kind): limit for t in self.tenants.values()
                  for kind, limit in zip(KINDS, (t.rpm, t.tpm, t.max_concurrent)) if limit is not None}
        started, now = time.monotonic(), time.time()

        def decide(others: list[dict]) -> list[dict]:
            used = lambda tenant, kind: self.limiter.used(tenant, kind, time.monotonic())  # noqa: E731
            return [asdict(row) for row in shares.decide(limits, used, [ShareRow(**o) for o in others], now)]

        spent = self.store.exchange_shares(self.replica, now - FORGET_S, decide)
        shares.committed(started)      # the lease runs from before the transaction: never longer
        self._merge_spent(spent)

    async def exchange_shares(self) -> None:
        await asyncio.to_thread(self._exchange)

    async def keep_shared(self) -> None:
        """Replicas only: exchange shares every SYNC_S; a store that cannot be reached is logged
        once per outage (the shares lapse after LEASE_S, see limit_shares.py)."""
        failing = False
        while True:
            await asyncio.sleep(SYNC_S)
            try:
                await self.exchange_shares()
                if failing:
                    log.warning("limits store %s reachable again", self.store.url)
                failing = False
            except Exception as exc:
                if not failing:
                    log.warning("limits store %s: %s; this replica's shares lapse if it lasts", self.store.url, exc)
                failing = True

    async def release_shares(self) -> None:
        if self.shared:
            try:
                await asyncio.to_thread(self.store.release_shares, self.replica)
            except Exception as exc:
                log.warning("could not give back this replica's limit shares (%s); they lapse in %.0f s",
                            exc, FORGET_S)

    def authenticate(self, authorization: str | None, tenant_header: str = "") -> Caller:
        """The caller behind a request's authorization header. With auth off, a request without
        a key we know (OpenAI clients send placeholders such as "EMPTY") is the tenant its
        x-tenant header names, else `anonymous`; with auth on it is refused."""
        try:
            key = bearer(authorization)
        except ServiceError:
            if self.required:
                raise
            key = None
        if key is not None and self.admin_key and hmac.compare_digest(key.encode(), self.admin_key.encode()):
            return Caller(Tenant(ADMIN_TENANT), admin=True)
        found = self.keys.get(hash_key(key)) if key is not None else None
        if found is not None:
            name, prefix = found
            if name == ADMIN_TENANT:      # a store from before the name was reserved
                raise ServiceError(ErrorKind.PERMISSION_DENIED, f"keys of a tenant named {ADMIN_TENANT!r} are refused: "
                                   "the name is the admin key's; give the tenant another name and new keys",
                                   field="authorization", reason="reserved_tenant")
            return Caller(self.tenants.get(name, Tenant(name)), prefix)
        if self.required:
            raise ServiceError(ErrorKind.UNAUTHENTICATED, "unknown or revoked API key" if key else
                               "an API key is required: send 'authorization: Bearer <key>' "
                               "(qos-serve keys create TENANT)", field="authorization",
                               reason="bad_key" if key else "no_key")
        # Every endpoint reading x-tenant (usage, alerts, the console) holds it to Generate's rule.
        try:
            name = parse_tenant(tenant_header) or ANONYMOUS
        except ValueError as exc:
            raise invalid(str(exc), field=TENANT_HEADER) from None
        return Caller(self.tenants.get(name, Tenant(name)))

    def admit(self, caller: Caller, priority: int, estimated_tokens: int, rate_limited: bool = True) -> Pass:
        """Entitlement and limits, before routing; raises ServiceError (403 / 429). Not
        `rate_limited` (a batch's line): entitlement and budget only (Limiter.entitled)."""
        if caller.admin:
            return Pass(caller)
        now = time.monotonic()
        if self.stale_for(now) and limited(caller.tenant):
            # Limits and budgets are enforced from a copy of the store: past stale_s that copy may
            # be far off, so they fail closed; a tenant without any is served as before.
            raise unavailable(f"the tenant store has not been read for {now - self.read_at:.0f} s; "
                              f"tenant {caller.name!r} has limits or a budget, which cannot be checked "
                              "until it answers", retry_after_ms=round(self.refresh_s * 1000),
                              reason="store_unreachable")
        if not rate_limited:
            self.limiter.entitled(caller.tenant, priority_name(priority), self.spent.get(caller.name, 0.0))
            return Pass(caller)
        reservation = self.limiter.admit(caller.tenant, priority_name(priority), estimated_tokens,
                                         self.spent.get(caller.name, 0.0), now)
        return Pass(caller, reservation)

    def release(self, ticket: Pass, used_tokens: int | None, amount: float) -> None:
        """The request ended: free its stream, true up its tokens, add what it cost."""
        if ticket.reservation is not None:
            self.limiter.release(ticket.reservation, used_tokens)
        if amount and ticket.caller.tenant.budget is not None:
            self.spent[ticket.caller.name] = self.spent.get(ticket.caller.name, 0.0) + amount

    def headers(self, caller: Caller) -> dict[str, str]:
        return {} if caller.admin else self.limiter.headers(caller.tenant, time.monotonic())


def store_metrics(book: TenantBook):
    """For the router's /metrics (a StateCollector): how old the tenant cache is, and whether
    limited tenants are being refused for it."""
    now = time.monotonic()
    yield GaugeMetricFamily("qos_store_seconds_since_read", "Seconds since the router last read keys, "
                            "tenants and spending from the store", value=now - book.read_at)
    yield GaugeMetricFamily("qos_store_failing_refreshes", "Refreshes from the store that failed in a row",
                            value=book.refresh_failures)
    yield GaugeMetricFamily("qos_store_limits_failing_closed", "1 while tenants with limits or a budget are "
                            "refused because the store has not been read for [store] stale_s",
                            value=1.0 if book.stale_for(now) else 0.0)
