"""Tenants and money around the request path (services/router/request_path.py):
let a request in (services/control/tenancy.py), price it, settle it when it ends (limits trued up,
a ledger row: services/control/ledger.py), and find, cancel or report requests on behalf of whoever
asks, each tenant seeing only its own.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

from services.common.errors import ErrorKind, ServiceError, invalid
from services.common.priority import ORDER, priority_name
from services.control.ledger import LedgerWriter
from services.control.storage_quota import limit_of
from services.control.tenancy import Caller, Pass, TenantBook
from services.store import storage_use

REQUEST_ID_MAX = 64          # the ledger's request_id column (services/store/schema.py)


# What this module reads of the request path's objects (the router's RequestHead, PoolSpec and
# Tally satisfy them): the control plane names what it needs instead of importing the router.
class Head(Protocol):
    request_id: str
    priority: int
    choice: int               # of a request with n choices: the prompt is billed with the first (0)
    batch: bool               # a line of a batch (the Batch API): not held to the tenant's rate limits


class PricedPool(Protocol):
    name: str
    device: str
    cost: float


class Usage(Protocol):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int        # of prompt_tokens, from the prefix cache
    outcome: str              # "completed", "failed" or "cancelled"; "" before it ended
    started_wall: float


@dataclass(slots=True)
class InFlight:
    request_id: str
    tenant: str
    priority: str
    task: asyncio.Task | None
    started: float
    cancelled_by: str = ""
    billed: bool = False          # its ledger row is recorded already (commit_completed)


def billed_prompt(head: Head, usage: Usage) -> tuple[int, int]:
    """The (prompt, cached) tokens a request is billed for: a request with n choices runs one
    sequence a choice and bills its prompt once, with the first (OpenAI's usage counts it once);
    the others share it through the prefix cache and bill their completions."""
    return (0, 0) if head.choice else (usage.prompt_tokens, usage.cached_tokens)


def not_found(request_id: str) -> ServiceError:
    # The same answer whether the request is another tenant's or does not exist: a key never
    # learns which ids other tenants use.
    return ServiceError(ErrorKind.NOT_FOUND, f"no request {request_id!r} of yours is in flight or "
                        "in the ledger", field="request_id", reason="not_found")


class Accounts:
    def __init__(self, book: TenantBook, ledger: LedgerWriter, multipliers: list[float],
                 cached_fraction: float = 0.5):
        self.book = book
        self.ledger = ledger
        self.multipliers = dict(zip(ORDER, map(float, multipliers)))
        self.cached_fraction = cached_fraction      # of a computed prompt token's price
        self.in_flight: dict[str, InFlight] = {}

    # --- one request ---------------------------------------------------------------------------------

    def admit(self, caller: Caller, head: Head, estimated_tokens: int) -> Pass:
        ticket = self.book.admit(caller, head.priority, estimated_tokens, rate_limited=not head.batch)
        self.in_flight[head.request_id] = InFlight(head.request_id, caller.name, priority_name(head.priority),
                                                   asyncio.current_task(), time.time())
        return ticket

    def amount(self, spec: PricedPool, priority: int, tokens: int, cached: int = 0) -> float:
        """What `tokens` (prompt + completion) cost on that pool in that class (cost units), of
        which `cached` prompt tokens came from the prefix cache (at cached_fraction of the price)."""
        return (tokens - cached * (1.0 - self.cached_fraction)) * spec.cost * self.multipliers[priority]

    def _row(self, ticket: Pass, head: Head, tally: Usage, spec: PricedPool, model: str) -> dict:
        prompt, cached = billed_prompt(head, tally)
        return {"request_id": head.request_id, "tenant": ticket.caller.name,
                "key_prefix": ticket.caller.key_prefix, "priority": priority_name(head.priority),
                "pool": spec.name, "device": spec.device, "model": model,
                "prompt_tokens": prompt, "completion_tokens": tally.completion_tokens,
                "cached_tokens": cached, "cached_fraction": self.cached_fraction,
                "price_per_token": spec.cost, "multiplier": self.multipliers[head.priority],
                "amount": self.amount(spec, head.priority, prompt + tally.completion_tokens, cached),
                "outcome": tally.outcome or "cancelled", "started_at": tally.started_wall,
                "finished_at": time.time()}

    async def commit_completed(self, ticket: Pass, head: Head, tally: Usage, spec: PricedPool,
                               model: str) -> None:
        """A request completed: its row committed to the ledger before its final chunk goes to
        the client (services/control/ledger.py), so a client never sees a completion that was
        not billed. settle() then writes no second row."""
        entry = self.in_flight.get(head.request_id)
        if entry is not None:
            entry.billed = True
        await self.ledger.commit(self._row(ticket, head, tally, spec, model))

    def settle(self, ticket: Pass, head: Head, tally: Usage | None, spec: PricedPool | None,
               model: str) -> None:
        """The request ended (`tally` None: before it was admitted): its stream and reserved tokens
        are released, and if it produced tokens (or completed) its row goes to the ledger, unless
        commit_completed() wrote it."""
        entry = self.in_flight.pop(head.request_id, None)
        if tally is None:
            self.book.release(ticket, None, 0.0)
            return
        prompt, cached = billed_prompt(head, tally)
        tokens = prompt + tally.completion_tokens
        billable = spec is not None and (tally.completion_tokens > 0 or tally.outcome == "completed")
        amount = self.amount(spec, head.priority, tokens, cached) if billable else 0.0
        self.book.release(ticket, tokens if tally.outcome else None, amount)
        if billable and not (entry is not None and entry.billed):
            self.ledger.record(self._row(ticket, head, tally, spec, model))

    # --- on behalf of a caller --------------------------------------------------------------------

    def _owns(self, caller: Caller, tenant: str) -> bool:
        """Whether `caller` may read or cancel a request of `tenant`: the admin key, or with auth
        on a key of that tenant. With auth off a tenant is whatever x-tenant says, so naming it
        proves nothing: only the admin key reads or cancels a request."""
        return caller.admin or (self.book.required and tenant == caller.name)

    def _mine(self, caller: Caller, request_id: str) -> InFlight | None:
        if not caller.admin and not self.book.required:
            raise ServiceError(ErrorKind.PERMISSION_DENIED, "with [auth] required off, reading or cancelling a "
                               "request by its id needs the admin key (a client cancels its own by closing "
                               "its stream)", field="authorization", reason="admin_only")
        entry = self.in_flight.get(request_id)
        return entry if entry is not None and self._owns(caller, entry.tenant) else None

    def cancel(self, caller: Caller, request_id: str) -> InFlight:
        entry = self._mine(caller, request_id)
        if entry is None or entry.task is None:
            raise not_found(request_id)
        entry.cancelled_by = caller.name
        entry.task.cancel()
        return entry

    def was_cancelled(self, request_id: str) -> str:
        entry = self.in_flight.get(request_id)
        return entry.cancelled_by if entry else ""

    async def request(self, caller: Caller, request_id: str) -> dict:
        """One request: in flight, or its ledger row."""
        entry = self._mine(caller, request_id)
        if entry is not None:
            return {"request_id": request_id, "tenant": entry.tenant, "priority": entry.priority,
                    "status": "in_flight", "started_at": entry.started}
        if len(request_id) > REQUEST_ID_MAX or not request_id.isprintable():
            raise not_found(request_id)     # no ledger row has such an id (PostgreSQL refuses a NUL)
        rows = await asyncio.to_thread(self.book.store.ledger_rows, request_id=request_id)
        if not rows or not self._owns(caller, rows[0]["tenant"]):
            raise not_found(request_id)
        return {**rows[0], "status": rows[0]["outcome"]}

    async def usage(self, caller: Caller, tenant: str | None = None, since: float | None = None,
                    since_field: str = "since") -> dict:
        """Totals from the ledger by tenant and priority (summed by the store's database), for the
        caller's tenant; the admin key may name any tenant, or none for all. `since`: unix seconds
        (0 up to 12 digits, as HTTP's parameter allows), else INVALID naming `since_field`."""
        if since is not None and not 0.0 <= since < 1e12:       # NaN fails this too
            raise invalid(f"{since_field} must be unix seconds from 0 to 12 digits, got {since!r}", field=since_field)
        if tenant and not caller.admin and tenant != caller.name:
            raise ServiceError(ErrorKind.PERMISSION_DENIED, "a tenant key sees only its own usage",
                               field="tenant", reason="not_your_tenant")
        if not caller.admin:
            tenant = caller.name
        lines = await asyncio.to_thread(self.book.store.usage_lines, tenant or None, since)
        total = {key: sum(line[key] for line in lines)
                 for key in ("requests", "prompt_tokens", "completion_tokens", "amount")}
        in_flight = sum(1 for e in self.in_flight.values() if not tenant or e.tenant == tenant)
        # what it keeps in the store now (files, kept responses, conversations) and its limit
        stored = await asyncio.to_thread(storage_use.used_by, self.book.store.engine, tenant or None)
        named = caller.tenant if not caller.admin else self.book.tenants.get(tenant)
        limit = limit_of(named, self.book.storage_mb) if tenant else None
        return {"tenant": tenant or "*", "since": since, "lines": lines, **total, "in_flight": in_flight,
                "storage_bytes": stored, "storage_limit_bytes": limit}
