"""Who is calling, and the gate every request passes at the router before it is routed:
authentication (API key -> tenant), entitlements and limits (services/control/limits.py), and,
when it ends, its line in the billing ledger (services/control/ledger.py).

The router never queries the database on the request path: keys, tenants and what each tenant
has spent are cached here and re-read from the store every REFRESH_S seconds (in a helper thread),
so `qos-serve tenants|keys` changes apply within that time. With [auth] replicas above 1, the
replicas also exchange their shares of the limits, and what each tenant spent, every SYNC_S
(services/control/limit_shares.py).

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

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import priority_name
from services.control.limit_shares import FORGET_S, KINDS, SYNC_S, SharedLimits, ShareRow
from services.control.limits import Limiter, Reservation
from services.store.store import Store, Tenant, hash_key

log = logging.getLogger(__name__)

REFRESH_S = 5.0
ANONYMOUS = "anonymous"
ADMIN = "admin"
ADMIN_KEY_ENV = "QOS_ADMIN_KEY"


@dataclass(slots=True, frozen=True)
class Caller:
    tenant: Tenant
    key_prefix: str = ""
    admin: bool = False

    @property
    def name(self) -> str:
        return self.tenant.name


@dataclass(slots=True)
class Pass:
    """A request let through the gate: whom to bill, and what it reserved."""
    caller: Caller
    reservation: Reservation | None = None


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
    def __init__(self, store: Store, required: bool = False, admin_key: str = "", replicas: int = 1):
        self.store = store
        self.required = required
        self.admin_key = admin_key or os.environ.get(ADMIN_KEY_ENV, "")
        self.replica = f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(3)}"
        self.limiter = Limiter(SharedLimits(self.replica) if replicas > 1 else None)
        self.keys: dict[str, tuple[str, str]] = {}      # key hash -> (tenant, prefix)
        self.tenants: dict[str, Tenant] = {}
        self.spent: dict[str, float] = {}
        self.loaded = asyncio.Event()

    async def refresh(self) -> None:
        """Re-read keys, tenants and spending (in a helper thread)."""
        keys, tenants, spent = await asyncio.to_thread(
            lambda: (self.store.active_keys(), self.store.tenants(), self.store.spent()))
        self.keys, self.tenants = keys, {t.name: t for t in tenants}
        # Keep local additions not yet in the database (the ledger writes in batches).
        self.spent = {name: max(amount, self.spent.get(name, 0.0)) for name, amount in spent.items()} | \
            {name: amount for name, amount in self.spent.items() if name not in spent}
        self.loaded.set()

    async def keep_fresh(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:      # the database may be down for a moment: keep the cache
                log.warning("tenant store %s: %s; keeping the cached tenants", self.store.url, exc)
            await asyncio.sleep(REFRESH_S)

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
        self.spent = {name: max(amount, self.spent.get(name, 0.0)) for name, amount in spent.items()} | \
            {name: amount for name, amount in self.spent.items() if name not in spent}

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
            return Caller(Tenant(ADMIN), admin=True)
        found = self.keys.get(hash_key(key)) if key is not None else None
        if found is not None:
            name, prefix = found
            return Caller(self.tenants.get(name, Tenant(name)), prefix)
        if self.required:
            raise ServiceError(ErrorKind.UNAUTHENTICATED, "unknown or revoked API key" if key else
                               "an API key is required: send 'authorization: Bearer <key>' "
                               "(qos-serve keys create TENANT)", field="authorization",
                               reason="bad_key" if key else "no_key")
        name = tenant_header or ANONYMOUS
        return Caller(self.tenants.get(name, Tenant(name)))

    def admit(self, caller: Caller, priority: int, estimated_tokens: int) -> Pass:
        """Entitlement and limits, before routing; raises ServiceError (403 / 429)."""
        if caller.admin:
            return Pass(caller)
        reservation = self.limiter.admit(caller.tenant, priority_name(priority), estimated_tokens,
                                         self.spent.get(caller.name, 0.0), time.monotonic())
        return Pass(caller, reservation)

    def release(self, ticket: Pass, used_tokens: int | None, amount: float) -> None:
        """The request ended: free its stream, true up its tokens, add what it cost."""
        if ticket.reservation is not None:
            self.limiter.release(ticket.reservation, used_tokens)
        if amount:
            self.spent[ticket.caller.name] = self.spent.get(ticket.caller.name, 0.0) + amount

    def headers(self, caller: Caller) -> dict[str, str]:
        return {} if caller.admin else self.limiter.headers(caller.tenant, time.monotonic())
