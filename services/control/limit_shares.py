"""Router replicas share each tenant's limits through the store (pure Python, the store's
transaction and a clock passed in).

Each replica holds a share of every limited tenant's rpm, tpm and max_concurrent, and admits
locally within its share: the request path never waits for the database. Twice a second
(SYNC_S) each replica exchanges with the store, in one transaction that holds the table's lock:

    it reads every replica's row (share, what it uses, its recent demand, its heartbeat);
    the limit's free part (limit - what all replicas use) is divided by demand (each live
    replica weighs 1 + what it asked lately, admitted or refused), and each replica's target is
    what it uses plus its part;
    it lowers its own share at once (never below what it uses: entries already in its window stay
    there), and raises it only into what the others' shares leave free.

So the shares always sum to at most the limit (until an operator lowers the limit below what
is in use), and the sum over replicas of what they admitted in any 60 s never exceeds it. A
replica that takes all of a tenant's traffic gets the whole limit within a second or two.

Faults, and the bounds they leave (docs/security.md, docs/tenants-and-billing.md):
- a replica that cannot reach the store for LEASE_S admits no request of a limited tenant (a
  precise UNAVAILABLE: another replica can take it); the others keep counting its rows until
  FORGET_S after its last heartbeat, when everything it admitted has left the 60 s window. A
  router that dies therefore holds its shares (about what it was using) for up to 70 s;
- max_concurrent is the exception: streams still open on a replica cut off from the store for
  longer than FORGET_S can take a tenant over its limit by that many streams;
- a replica shutting down cleanly gives its shares back at once;
- heartbeats are each replica's wall clock: hosts' clocks must agree to within a second (NTP).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import ErrorKind, ServiceError

KINDS = ("rpm", "tpm", "concurrent")
SYNC_S = 0.5              # how often a replica exchanges with the store
STALE_S = 3.0             # a replica silent this long gets no new part of the free limit
LEASE_S = 10.0            # a replica that has not exchanged for this long stops admitting limited tenants
FORGET_S = 60.0 + LEASE_S  # ... and the others drop its rows after this (the 60 s window plus the lease)
DEMAND_DECAY = 0.5        # recent demand: half the previous exchange's, plus what was asked since


@dataclass(slots=True)
class ShareRow:
    """One replica's share of one tenant's limit, as the store holds it."""
    replica: str
    tenant: str
    kind: str
    share: int
    used: int
    demand: float
    heartbeat: float


def divide(limit: int, rows: list[ShareRow], now: float) -> dict[str, int]:
    """Every replica's target: what it uses, plus a part of the free rest in proportion to its
    weight (largest remainders, ties by replica id, so every replica computes the same split)."""
    free = max(0, limit - sum(r.used for r in rows))
    weights = {r.replica: (1.0 + r.demand) if now - r.heartbeat <= STALE_S else 0.0 for r in rows}
    total = sum(weights.values())
    exact = {r.replica: free * weights[r.replica] / total if total else 0.0 for r in rows}
    parts = {name: int(value) for name, value in exact.items()}
    left = free - sum(parts.values()) if total else 0
    for name in sorted(exact, key=lambda n: (parts[n] - exact[n], n))[:left]:
        parts[name] += 1
    return {r.replica: r.used + parts[r.replica] for r in rows}


def settle(limit: int, mine: ShareRow, others: list[ShareRow], now: float) -> int:
    """My new share: toward my target, never below what I use, never into the others' shares."""
    target = divide(limit, [mine, *others], now)[mine.replica]
    ceiling = limit - sum(o.share for o in others)
    return max(mine.used, min(target, ceiling))


class SharedLimits:
    """One replica's shares. `exchange` runs in a helper thread (inside the store's transaction);
    the event loop asks `allowance` on each admission: `lock` keeps the two apart."""

    def __init__(self, replica: str):
        self.replica = replica
        self.lock = threading.RLock()       # decide() reads the limiter's windows while holding it
        self.granted: dict[tuple[str, str], int] = {}
        self.demand: dict[tuple[str, str], float] = {}
        self.asked: dict[tuple[str, str], float] = {}
        self.last_exchange: float | None = None        # monotonic time of the last committed one
        self.pending: dict[tuple[str, str], int] = {}  # raises, applied once the store has them

    def ask(self, tenant: str, kind: str, amount: float) -> None:
        """A request asked for `amount` of a limit (admitted or not): demand for the next exchange."""
        key = (tenant, kind)
        self.asked[key] = self.asked.get(key, 0.0) + amount

    def allowance(self, tenant: str, kind: str, now: float) -> int:
        """What this replica may admit of the tenant's limit (called with `lock` held)."""
        if self.last_exchange is None or now - self.last_exchange > LEASE_S:
            raise ServiceError(ErrorKind.UNAVAILABLE, f"this router replica has not reached the limits store "
                               f"for over {LEASE_S:.0f} s, so it cannot admit tenant {tenant}'s limited "
                               "requests; retry (another replica may take it)", retry_after_ms=1000,
                               reason="limits_store_unreachable")
        return self.granted.get((tenant, kind), 0)

    def decide(self, limits: dict[tuple[str, str], int], usage: Callable[[str, str], int],
               others: list[ShareRow], now: float) -> list[ShareRow]:
        """Inside the store's transaction: my rows to write. Lowered shares apply here, at once;
        raised ones wait for `committed` (the store must hold a share before it is used)."""
        by_key: dict[tuple[str, str], list[ShareRow]] = {}
        for row in others:
            by_key.setdefault((row.tenant, row.kind), []).append(row)
        rows = []
        with self.lock:
            asked, self.asked = self.asked, {}
            self.pending = {}
            for key, limit in limits.items():
                demand = DEMAND_DECAY * self.demand.get(key, 0.0) + asked.get(key, 0.0)
                self.demand[key] = demand
                mine = ShareRow(self.replica, key[0], key[1], self.granted.get(key, 0), usage(*key), demand, now)
                theirs = by_key.get(key, [])
                mine.share = settle(limit, mine, theirs, now)
                if mine.share <= self.granted.get(key, 0):
                    self.granted[key] = mine.share
                else:
                    self.pending[key] = mine.share
                rows.append(mine)
            for key in [k for k in self.granted if k not in limits]:    # the limit was lifted
                del self.granted[key]
        return rows

    def committed(self, now_monotonic: float) -> None:
        with self.lock:
            self.granted.update(self.pending)
            self.pending = {}
            self.last_exchange = now_monotonic
