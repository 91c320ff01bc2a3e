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

Several router replicas: each enforces `1/replicas` of rpm, tpm and max_concurrent (rounded up),
so the sum over replicas behind a load balancer holds the tenant's limit; budgets are global (the
ledger in the shared database, re-read every few seconds).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from services.common.errors import ErrorKind, ServiceError
from services.common.wire import prompt_chars
from services.store.store import Tenant

WINDOW_S = 60.0
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
class Reservation:
    tenant: str
    tokens: list | None = None      # its entry in the tenant's token window


class Limiter:
    def __init__(self, replicas: int = 1):
        self.replicas = max(1, replicas)
        self.requests: dict[str, Window] = {}
        self.tokens: dict[str, Window] = {}
        self.open: dict[str, int] = {}

    def share(self, limit: int | None) -> int | None:
        return None if limit is None else math.ceil(limit / self.replicas)

    def admit(self, tenant: Tenant, priority: str, tokens: int, spent: float, now: float) -> Reservation:
        """Check every limit; raises ServiceError for the first one exceeded, else reserves."""
        if priority not in tenant.priorities:
            raise ServiceError(ErrorKind.PERMISSION_DENIED,
                               f"tenant {tenant.name} may send {', '.join(tenant.priorities)} requests, "
                               f"not {priority}", field="x-priority", reason="priority_not_allowed")
        if tenant.budget is not None and spent >= tenant.budget:
            raise ServiceError(ErrorKind.EXHAUSTED,
                               f"tenant {tenant.name} has spent {spent:.1f} of its budget of "
                               f"{tenant.budget:.1f} cost units; raise it with `qos-serve tenants set "
                               f"{tenant.name} --budget N`", reason="insufficient_quota")
        requests = self.requests.setdefault(tenant.name, Window())
        token_window = self.tokens.setdefault(tenant.name, Window())
        requests.trim(now)
        token_window.trim(now)
        rpm, tpm, concurrent = self.share(tenant.rpm), self.share(tenant.tpm), self.share(tenant.max_concurrent)
        if rpm is not None and requests.total + 1 > rpm:
            raise self._over(tenant, "requests per minute", rpm, requests.reset_in(now), "rate_limit_requests")
        if tpm is not None and token_window.total + tokens > tpm:
            if tokens > tpm:
                raise ServiceError(ErrorKind.TOO_LARGE, f"the request may use {tokens} tokens (prompt + "
                                   f"max_tokens) but tenant {tenant.name} has {tpm} tokens per minute",
                                   field="max_tokens", reason="rate_limit_tokens")
            raise self._over(tenant, "tokens per minute", tpm, token_window.reset_in(now), "rate_limit_tokens")
        if concurrent is not None and self.open.get(tenant.name, 0) >= concurrent:
            raise ServiceError(ErrorKind.EXHAUSTED, f"tenant {tenant.name} has {concurrent} streams open "
                               "(max_concurrent); retry when one ends", retry_after_ms=1000,
                               reason="rate_limit_concurrency")
        requests.add(now, 1)
        self.open[tenant.name] = self.open.get(tenant.name, 0) + 1
        return Reservation(tenant.name, token_window.add(now, tokens))

    @staticmethod
    def _over(tenant: Tenant, what: str, limit: int, reset_s: float, reason: str) -> ServiceError:
        retry_ms = max(1, math.ceil(reset_s * 1000))
        return ServiceError(ErrorKind.EXHAUSTED, f"tenant {tenant.name} is over its {limit} {what}; "
                            f"retry after {retry_ms} ms", retry_after_ms=retry_ms, reason=reason)

    def release(self, reservation: Reservation, used_tokens: int | None) -> None:
        """The request ended: its stream closes; its reserved tokens become what it really used."""
        self.open[reservation.tenant] = max(0, self.open.get(reservation.tenant, 1) - 1)
        if used_tokens is not None and reservation.tokens is not None:
            self.tokens[reservation.tenant].correct(reservation.tokens, used_tokens)

    def headers(self, tenant: Tenant, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-* response headers for the tenant's request and token windows."""
        out = {}
        for kind, limit, window in (("requests", self.share(tenant.rpm), self.requests.get(tenant.name)),
                                    ("tokens", self.share(tenant.tpm), self.tokens.get(tenant.name))):
            if limit is None:
                continue
            window = window or Window()
            window.trim(now)
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, limit - window.total))
            out[f"x-ratelimit-reset-{kind}"] = f"{window.reset_in(now):.3f}s"
        return out
