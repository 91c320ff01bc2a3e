"""Per-tenant limits at the router, checked before routing (pure Python, a clock passed in):

    priorities      a request above its tenant's entitlement -> PERMISSION_DENIED naming it
    rpm             requests started in the last 60 s
    tpm             tokens in the last 60 s: prompt (estimated from its length) + max_tokens are
                    reserved when a request starts and corrected to the real usage when it ends
    max_concurrent  streams open at once
    budget          cost units spent, all time (from the ledger) -> no retry-after: it does not
                    come back by waiting, only by raising the budget

Windows slide: a refused request is told when the oldest entry leaves the window (retry-after),
and HTTP responses carry OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens}.

Every admission trims its tenant's windows, limited or not, and forgets the tenants with no stream
open whose last request has left the window: what is kept is what counts (the last minute's
requests), however many tenant names come and go (with auth off, any x-tenant is a tenant).

Several router replicas: each admits within its share of rpm, tpm and max_concurrent, shares the
replicas agree through the store twice a second (services/control/limit_shares.py), so the sum
over replicas behind a load balancer holds the tenant's limit; budgets are global (what each
tenant spent, re-read from the store with every exchange).
"""
from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass, field

from services.common.errors import ErrorKind, ServiceError
from services.common.idle_keys import IdleKeys
from services.common.wire import prompt_chars
from services.control.limit_shares import SYNC_S, SharedLimits
from services.store.store import Tenant

WINDOW_S = 60.0
RESHARE_S = 4 * SYNC_S        # a replica over its share: retry within this (shares move meanwhile)
CHARS_PER_TOKEN = 4           # prompt tokens are estimated from the text's length until usage is known
DEFAULT_MAX_TOKENS = 256      # what the scheduler gives a request that names no max_tokens


def estimated_prompt_tokens(request) -> int:
    return math.ceil(prompt_chars(request) / CHARS_PER_TOKEN)


def estimate_tokens(text_chars: int, max_tokens: int | None) -> int:
    return math.ceil(text_chars / CHARS_PER_TOKEN) + (max_tokens or DEFAULT_MAX_TOKENS)


@dataclass(slots=True)
class Window:
    """Amounts added over the last WINDOW_S seconds (a sliding window)."""
    entries: deque = field(default_factory=deque)    # [time, amount] (amount corrected in place)
    total: int = 0

    def trim(self, now: float) -> None:
        while self.entries and self.entries[0][0] <= now - WINDOW_S:
            self.total -= self.entries.popleft()[1]

    def add(self, now: float, amount: int) -> list:
        entry = [now, amount]
        self.entries.append(entry)
        self.total += amount
        return entry

    def correct(self, entry: list, amount: int) -> None:
        # Entries leave in time order, so one is still here iff it is not older than the oldest.
        if self.entries and entry[0] >= self.entries[0][0]:
            self.total += amount - entry[1]
            entry[1] = amount

    def reset_in(self, now: float) -> float:
        """Seconds until the oldest entry leaves the window."""
        return max(0.0, self.entries[0][0] + WINDOW_S - now) if self.entries else 0.0


@dataclass(slots=True)
class TenantUse:
    """What this router has of one tenant's limits in use."""
    requests: Window = field(default_factory=Window)
    tokens: Window = field(default_factory=Window)
    open: int = 0                   # streams open

    def window(self, kind: str) -> Window:
        return self.requests if kind == "rpm" else self.tokens


NO_USE = TenantUse()                # what a tenant not known here has in use: nothing (never changed)


@dataclass(slots=True)
class Reservation:
    tenant: str
    tokens: list | None = None      # its entry in the tenant's token window


class Limiter:
    def __init__(self, shares: SharedLimits | None = None):
        self.shares = shares          # None: this router is the only one and enforces the whole limits
        self.tenants: dict[str, TenantUse] = {}
        self.seen = IdleKeys(WINDOW_S)        # tenants by their last admission

    def _held(self):
        return self.shares.lock if self.shares is not None else contextlib.nullcontext()

    def used(self, tenant: str, kind: str, now: float) -> int:
        """What this router has of a tenant's limit in use: requests or tokens in the window, open streams."""
        use = self.tenants.get(tenant, NO_USE)
        if kind == "concurrent":
            return use.open
        window = use.window(kind)
        window.trim(now)
        return window.total

    def forget_idle(self, now: float) -> None:
        """Drop the tenants with no stream open whose last admission has left the window (so has
        every entry of theirs): they have nothing in use. One with a stream open is looked at
        again a window later."""
        tenants = self.tenants
        for name in self.seen.idle(now, busy=lambda name: tenants[name].open > 0):
            del tenants[name]
        if self.seen.compact():
            self.tenants = dict(tenants)

    def _allowance(self, tenant: str, kind: str, limit: int | None, amount: int, now: float) -> int | None:
        if limit is None or self.shares is None:
            return limit
        self.shares.ask(tenant, kind, amount)
        return self.shares.allowance(tenant, kind, now)

    @staticmethod
    def entitled(tenant: Tenant, priority: str, spent: float) -> None:
        """The class is one the tenant may send, and its budget is not spent; else ServiceError.
        (A batch's lines are held to these alone: rpm, tpm and max_concurrent are the tenant's
        interactive traffic's, as OpenAI keeps batch limits apart.)"""
        if priority not in tenant.priorities:
            raise ServiceError(ErrorKind.PERMISSION_DENIED,
                               f"tenant {tenant.name} may send {', '.join(tenant.priorities)} requests, "
                               f"not {priority}", field="x-priority", reason="priority_not_allowed")
        if tenant.budget is not None and spent >= tenant.budget:
            raise ServiceError(ErrorKind.EXHAUSTED,
                               f"tenant {tenant.name} has spent {spent:.1f} of its budget of "
                               f"{tenant.budget:.1f} cost units; raise it with `qos-serve tenants set "
                               f"{tenant.name} --budget N`", reason="insufficient_quota")

    def admit(self, tenant: Tenant, priority: str, tokens: int, spent: float, now: float) -> Reservation:
        """Check every limit; raises ServiceError for the first one exceeded, else reserves."""
        self.entitled(tenant, priority, spent)
        if tenant.tpm is not None and tokens > tenant.tpm:
            raise ServiceError(ErrorKind.TOO_LARGE, f"the request may use {tokens} tokens (prompt + "
                               f"max_tokens) but tenant {tenant.name} has {tenant.tpm} tokens per minute",
                               field="max_tokens", reason="rate_limit_tokens")
        name = tenant.name
        with self._held():
            self.forget_idle(now)
            use = self.tenants.get(name)
            if use is None:
                use = self.tenants[name] = TenantUse()
            self.seen.see(name, now)
            use.requests.trim(now)
            use.tokens.trim(now)
            rpm = self._allowance(name, "rpm", tenant.rpm, 1, now)
            tpm = self._allowance(name, "tpm", tenant.tpm, tokens, now)
            concurrent = self._allowance(name, "concurrent", tenant.max_concurrent, 1, now)
            if rpm is not None and self.used(name, "rpm", now) + 1 > rpm:
                raise self._over(tenant, "rpm", tenant.rpm, rpm, use.requests.reset_in(now))
            if tpm is not None and self.used(name, "tpm", now) + tokens > tpm:
                raise self._over(tenant, "tpm", tenant.tpm, tpm, use.tokens.reset_in(now))
            if concurrent is not None and use.open >= concurrent:
                raise ServiceError(ErrorKind.EXHAUSTED, f"tenant {name} has {use.open} streams "
                                   f"open {self._of(tenant.max_concurrent, concurrent)}(max_concurrent "
                                   f"{tenant.max_concurrent}); retry when one ends", retry_after_ms=1000,
                                   reason="rate_limit_concurrency")
            use.requests.add(now, 1)
            use.open += 1
            return Reservation(name, use.tokens.add(now, tokens))

    @staticmethod
    def _of(limit: int, allowance: int) -> str:
        """Where replicas share the limit, the part this one holds."""
        return "" if allowance >= limit else f"on this router, whose share is {allowance} "

    def _over(self, tenant: Tenant, kind: str, limit: int, allowance: int, reset_s: float) -> ServiceError:
        what = {"rpm": "requests per minute", "tpm": "tokens per minute"}[kind]
        reason = {"rpm": "rate_limit_requests", "tpm": "rate_limit_tokens"}[kind]
        if allowance < limit and self.shares is not None:
            # Only this replica's share is spent. Shares move within a second or two, and when the
            # other replicas' entries leave the window is theirs to know: ask again in 2 s at most.
            reset_s = min(reset_s, RESHARE_S) if reset_s > 0 else RESHARE_S
        retry_ms = max(1, math.ceil(reset_s * 1000))
        share = self._of(limit, allowance).strip()
        return ServiceError(ErrorKind.EXHAUSTED, f"tenant {tenant.name} is over its {limit} {what}"
                            f"{' ' + share if share else ''}; retry after {retry_ms} ms",
                            retry_after_ms=retry_ms, reason=reason)

    def release(self, reservation: Reservation, used_tokens: int | None) -> None:
        """The request ended: its stream closes; its reserved tokens become what it really used."""
        with self._held():
            use = self.tenants.get(reservation.tenant)
            if use is None:         # not forgotten while a stream is open; nothing to release if so
                return
            use.open = max(0, use.open - 1)
            if used_tokens is not None and reservation.tokens is not None:
                use.tokens.correct(reservation.tokens, used_tokens)

    def headers(self, tenant: Tenant, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-* response headers for the tenant's request and token windows."""
        out = {}
        with self._held():
            for kind, name, limit in (("requests", "rpm", tenant.rpm), ("tokens", "tpm", tenant.tpm)):
                if limit is None:
                    continue
                allowance = limit if self.shares is None else self.shares.granted.get((tenant.name, name), 0)
                used = self.used(tenant.name, name, now)
                out[f"x-ratelimit-limit-{kind}"] = str(limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, allowance - used))
                reset_s = self.tenants.get(tenant.name, NO_USE).window(name).reset_in(now)
                out[f"x-ratelimit-reset-{kind}"] = f"{reset_s:.3f}s"
        return out
