"""Router replicas sharing a tenant's limits through the store (services/control/limit_shares.py):
the split itself, and, over a real store (SQLite here; PostgreSQL in tests/e2e/test_router_replicas.py),
random interleavings of admissions, exchanges and time: the replicas together never admit more
than the limit in any 60 s, and one replica that takes all the traffic gets all of the limit."""
from __future__ import annotations

from dataclasses import asdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import ErrorKind, ServiceError
from services.control.limit_shares import FORGET_S, LEASE_S, SharedLimits, ShareRow, divide, settle
from services.control.limits import WINDOW_S, Limiter
from services.store.store import Store, Tenant


def row(replica: str, share: int, used: int, demand: float = 0.0, heartbeat: float = 0.0) -> ShareRow:
    return ShareRow(replica, "t", "rpm", share, used, demand, heartbeat)


def test_the_free_part_is_divided_by_demand_with_largest_remainders():
    assert divide(10, [row("a", 0, 0), row("b", 0, 0)], 0.0) == {"a": 5, "b": 5}
    # a busy replica (demand 13) and an idle one: 2 free, split 1.87 / 0.13 -> 2 / 0
    assert divide(10, [row("a", 10, 8, demand=13), row("b", 0, 0)], 0.0) == {"a": 10, "b": 0}
    # what each uses stays its own even when the limit is full
    assert divide(10, [row("a", 6, 6), row("b", 4, 4)], 0.0) == {"a": 6, "b": 4}
    # a silent replica keeps what it used but gets nothing of the free part
    assert divide(10, [row("a", 0, 0), row("b", 5, 2, heartbeat=-100.0)], 0.0) == {"a": 8, "b": 2}


def test_a_replica_never_raises_into_the_others_shares_nor_lowers_below_its_use():
    # b still holds 5 it no longer needs: a's target is 10 but it may take only 5 until b lowers
    assert settle(10, row("a", 5, 5, demand=20), [row("b", 5, 0)], 0.0) == 5
    assert settle(10, row("a", 5, 5, demand=20), [row("b", 0, 0)], 0.0) == 10
    # a limit lowered below what is in use: the share stays at the use (entries already admitted)
    assert settle(4, row("a", 6, 6), [row("b", 0, 0)], 0.0) == 6


class Replica:
    """One router's limiter with its shares, exchanging through a real store."""

    def __init__(self, name: str, store: Store):
        self.shares = SharedLimits(name)
        self.limiter = Limiter(self.shares)
        self.store = store

    def exchange(self, tenant: Tenant, now: float) -> None:
        limits = {(tenant.name, "rpm"): tenant.rpm}

        def decide(others):
            used = lambda t, k: self.limiter.used(t, k, now)  # noqa: E731
            return [asdict(r) for r in self.shares.decide(limits, used, [ShareRow(**o) for o in others], now)]

        self.store.exchange_shares(self.shares.replica, now - FORGET_S, decide)
        self.shares.committed(now)

    def admit(self, tenant: Tenant, now: float) -> bool:
        try:
            self.limiter.admit(tenant, "medium", 1, 0.0, now)
            return True
        except ServiceError as refused:
            # over the share, or out of touch with the store for longer than the lease
            assert refused.kind in (ErrorKind.EXHAUSTED, ErrorKind.UNAVAILABLE) and refused.retry_after_ms > 0
            return False


@pytest.fixture
def store(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/store.db")
    yield store
    store.close()


def test_one_replica_with_all_the_traffic_gets_the_whole_limit_within_a_few_exchanges(store):
    tenant = Tenant("t", rpm=12)
    a, b = Replica("a", store), Replica("b", store)
    now = 1000.0
    for replica in (a, b):
        replica.exchange(tenant, now)
    admitted = 0
    for _ in range(4):                     # a few exchange periods of a flood on a alone
        admitted += sum(a.admit(tenant, now) for _ in range(20))
        now += 0.5
        b.exchange(tenant, now)
        a.exchange(tenant, now)
    assert admitted == 12
    assert not b.admit(tenant, now)        # the tenant is at its limit everywhere
    now += WINDOW_S                        # the window passes: the limit is free again
    a.exchange(tenant, now)
    b.exchange(tenant, now)
    assert a.admit(tenant, now)


def test_a_replica_out_of_touch_with_the_store_stops_admitting(store):
    tenant = Tenant("t", rpm=100)
    a = Replica("a", store)
    a.exchange(tenant, 0.0)
    assert a.admit(tenant, 1.0)
    with pytest.raises(ServiceError) as refused:
        a.limiter.admit(tenant, "medium", 1, 0.0, LEASE_S + 1)
    assert refused.value.kind is ErrorKind.UNAVAILABLE and refused.value.retry_after_ms == 1000
    assert "limits store" in refused.value.message


def test_a_clean_stop_gives_the_shares_back(store):
    tenant = Tenant("t", rpm=10)
    a, b = Replica("a", store), Replica("b", store)
    a.exchange(tenant, 0.0)
    b.exchange(tenant, 0.0)
    a.exchange(tenant, 0.0)
    assert b.shares.granted[("t", "rpm")] + a.shares.granted[("t", "rpm")] <= 10
    store.release_shares("a")
    b.exchange(tenant, 0.1)
    assert b.shares.granted[("t", "rpm")] == 10


STEPS = st.lists(st.tuples(st.sampled_from(["admit", "exchange", "tick", "die"]), st.integers(0, 2),
                           st.integers(1, 8)), min_size=5, max_size=60)


@settings(max_examples=40, deadline=None)
@given(STEPS, st.integers(1, 15))
def test_replicas_together_never_admit_more_than_the_limit_in_any_window(tmp_path_factory, steps, rpm):
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('shares')}/store.db")
    tenant = Tenant("t", rpm=rpm)
    replicas = [Replica(name, store) for name in "abc"]
    alive = [True] * 3
    now, admitted = 0.0, []                # (time, replica) of every admission
    for replica in replicas:
        replica.exchange(tenant, now)
    for action, which, amount in steps:
        replica = replicas[which]
        if action == "admit" and alive[which]:
            admitted += [(now, which)] * sum(replica.admit(tenant, now) for _ in range(amount))
        elif action == "exchange" and alive[which]:
            replica.exchange(tenant, now)
        elif action == "tick":
            now += amount * 2.5
        elif action == "die":              # killed: its rows stay until they are forgotten
            alive[which] = False
        in_window = [t for t, _ in admitted if t > now - WINDOW_S]
        assert len(in_window) <= rpm
        for replica, live in zip(replicas, alive):
            granted = replica.shares.granted.get(("t", "rpm"), 0)
            if live and replica.shares.last_exchange is not None and now - replica.shares.last_exchange <= LEASE_S:
                assert replica.limiter.used("t", "rpm", now) <= granted
    store.close()
