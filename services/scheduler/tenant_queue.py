"""One priority class's waiting requests, shared fairly between tenants.

Inside a class, tenants share its tokens by weight, with the same weighted fair queueing the
classes use between them (services/scheduler/policy.py): each tenant has a virtual time, advanced
by the tokens its requests are served (prefill and decode, running ones included) divided by its
weight, and the next request admitted is the oldest of the tenant with the smallest virtual time.
A tenant that was idle re-enters at the smallest virtual time among the waiting ones (with none
waiting: among those served last), so idle time banks no credit and service alone is no debt. So
a tenant with 200 queued requests cannot make another tenant's first request wait behind all of
them: it waits for one admission. With fairness off it is one FIFO.

A tenant with nothing waiting or running here for TENANT_IDLE_S is forgotten (forget_idle): its
virtual time and weight are dropped, so a class keeps the state of its recent tenants only, however
many tenant names come and go. Forgetting never puts a tenant behind: it would re-enter at the
larger of its own virtual time and the floor, and forgotten it re-enters at the floor, as a new
tenant does. What it forgives is a lead in service (own virtual time above the floor) after a
minute with nothing queued or running, as weighted fair queueing starts a newly active flow at
the system's virtual time once its own finish time is behind: the tenant gains nothing a new
tenant name would not give it.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator
from itertools import repeat
from operator import add, truediv

from services.common.idle_keys import IdleKeys
from services.scheduler.request import Request

ONE_LANE = ""        # the key every request shares when fairness is off
TENANT_IDLE_S = 60.0        # a tenant's state is kept this long with nothing waiting or running


class TenantQueue:
    def __init__(self, fair: bool = True):
        self.fair = fair
        self._by_tenant: dict[str, deque[Request]] = {}
        # Tenants with a request waiting, in the order they began to wait (a dict: ordered).
        self._waiting: dict[str, None] = {}
        self._vtime: dict[str, float] = {}
        self._weight: dict[str, float] = {}    # each tenant's share, as its latest request says
        self._floor = 0.0       # with nobody waiting: the least virtual time of those served last
        self._size = 0
        # Tenants by when they were last seen waiting or running (forget_idle's clock).
        self._seen = IdleKeys(TENANT_IDLE_S)
        self._now = 0.0         # forget_idle's last time: a request's arrival is seen then

    def _key(self, request: Request) -> str:
        return request.tenant if self.fair else ONE_LANE

    def _enter(self, key: str) -> deque[Request]:
        """The tenant's queue; a tenant that had nothing waiting re-enters at the smallest
        virtual time of those that do, or where service stands if none does (no credit for idle
        time, no debt for having been served while nobody else waited)."""
        queue = self._by_tenant.get(key)
        if queue:
            return queue
        vtime = self._vtime
        floor = min(map(vtime.__getitem__, self._waiting)) if self._waiting else self._floor
        vtime[key] = max(vtime.get(key, 0.0), floor)
        self._waiting[key] = None
        return self._by_tenant.setdefault(key, deque())

    def _arrive(self, request: Request) -> deque[Request]:
        if not self.fair:
            return self._enter(ONE_LANE)
        key = request.tenant
        self._weight[key] = request.tenant_weight or 1.0
        self._seen.see(key, self._now)
        return self._enter(key)

    def append(self, request: Request) -> None:
        self._arrive(request).append(request)
        self._size += 1

    def appendleft(self, request: Request) -> None:
        """A preempted request goes back first in its tenant's line."""
        self._arrive(request).appendleft(request)
        self._size += 1

    def remove(self, request: Request) -> None:
        key = self._key(request)
        queue = self._by_tenant[key]
        queue.remove(request)
        if not queue:
            del self._waiting[key]
            del self._by_tenant[key]
        self._size -= 1

    def forget_idle(self, now: float, running: Collection[str]) -> None:
        """Forget the tenants seen neither waiting nor among `running` (the tenants of this lane's
        running requests) for TENANT_IDLE_S; those still busy are seen now."""
        self._now = now
        waiting = self._waiting
        for key in self._seen.idle(now, busy=lambda key: key in waiting or key in running):
            self._vtime.pop(key, None)
            self._weight.pop(key, None)
        if self._seen.compact():
            self._vtime, self._weight = dict(self._vtime), dict(self._weight)
            self._waiting, self._by_tenant = dict(self._waiting), dict(self._by_tenant)

    def tenants_known(self) -> int:
        """How many tenants this queue holds any state of."""
        return max(len(self._seen), len(self._vtime.keys() | self._weight.keys() | self._by_tenant.keys()))

    def peek(self) -> Request | None:
        """The request to admit next: the oldest of the tenant with the smallest virtual time (of
        equal ones, the tenant waiting longest)."""
        if not self._waiting:
            return None
        return self._by_tenant[min(self._waiting, key=self._vtime.__getitem__)][0]

    def tokens_ahead(self, tenant: str, weight: float, own_tokens: int) -> float:
        """Tokens this queue serves before a new request of `tenant` (weight `weight`, `own_tokens`
        to compute) gets its turn: its tenant's queued tokens, and of each other tenant's at most
        what that tenant's weight earns while those and its own are served (one FIFO: everything
        queued). So the wait quoted to one tenant does not grow with another's flood beyond its
        share, and cannot be read as the size of that flood."""
        if not self.fair:
            return sum(r.pending for r in self)
        mine = sum(r.pending for r in self._by_tenant.get(tenant, ()))
        span = (mine + own_tokens) / weight
        weights = self._weight
        return mine + sum(min(sum(r.pending for r in queue), span * weights.get(key, 1.0))
                          for key, queue in self._by_tenant.items() if key != tenant)

    def charge(self, tokens_by_tenant: dict[str, int]) -> None:
        """Tokens were served to requests of these tenants (waiting or running)."""
        if self.fair:
            # vtime[t] += tokens / weight[t] for each tenant, in C-level maps: a plan charges each
            # of the lane's running tenants (dozens) several times (planner.py).
            vtime, tenants = self._vtime, tokens_by_tenant.keys()
            shares = map(truediv, tokens_by_tenant.values(), map(self._weight.get, tenants, repeat(1.0)))
            vtime.update(zip(tenants, map(add, map(vtime.get, tenants, repeat(0.0)), shares)))
            if not self._size:
                self._floor = min(map(vtime.__getitem__, tenants))

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        for queue in list(self._by_tenant.values()):
            yield from list(queue)
