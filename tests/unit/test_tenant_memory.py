"""Per tenant state is forgotten once its tenant is idle (services/common/idle_keys.py): with auth
off any x-tenant is a tenant, so 100,000 distinct tenants pass through the router's limiter and
tally and the scheduler's fair queues, time passes (injected, never slept), and the memory they
hold (tracemalloc) and the number of tenants they know are back to where they were after a
warm-up. Beside that, what forgetting must not change: a limited tenant's window and open
streams, the spending budgets are checked against, and the fair order of tenants that wait or
run while time races past the idle limit."""
from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import pytest
from opentelemetry.trace import INVALID_SPAN
from prometheus_client import CollectorRegistry

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import LOW, MEDIUM, ORDER
from services.common.proto.qos.v1 import common_pb2
from services.common.step import SamplingParams
from services.control.limits import WINDOW_S, Limiter
from services.control.tenancy import Caller, Pass, TenantBook
from services.router import tally
from services.router.tally import TENANT_IDLE_S as ROW_IDLE_S
from services.router.tally import RouterTotals
from services.scheduler.policy import TENANT_SWEEP_S, QoSSettings, create_policy
from services.scheduler.request import Phase, Request
from services.scheduler.tenant_queue import TENANT_IDLE_S as QUEUE_IDLE_S
from services.store.store import Tenant
from tests.unit.test_qos_scheduling import Harness

MIB = 1 << 20
# 100,000 tenants in the full suite; 10,000 in the fast one (state kept forever, as before, held
# over 6 MiB at 10,000 in each of these).
TENANTS = [pytest.param(100_000, marks=pytest.mark.slow, id="100k"), pytest.param(10_000, id="10k")]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def retained_after(run: Callable[[str, int], None], tenants: int, warm: int = 2_000) -> tuple[int, int]:
    """(bytes held after the warm-up, bytes held after `tenants` more): `run(prefix, n)` sends n
    distinct tenants through and lets their idle time pass."""
    tracemalloc.start()
    try:
        run("warm", warm)
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        run("t", tenants)
        gc.collect()
        return start, tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("tenants", TENANTS)
@pytest.mark.parametrize("limited", [False, True], ids=["unlimited", "limited"])
def test_the_limiter_forgets_tenants_once_their_window_has_passed(limited, tenants):
    limiter, clock = Limiter(), Clock()

    def tenant(name: str) -> Tenant:
        return Tenant(name, rpm=5, tpm=10_000, max_concurrent=2) if limited else Tenant(name)

    def run(prefix: str, n: int) -> None:
        for i in range(n):      # 1,000 new tenants a second: 60,000 inside the window at the peak
            limiter.release(limiter.admit(tenant(f"{prefix}{i}"), "medium", 40, 0.0, clock.now), 30)
            clock.now += 0.001
        clock.now += WINDOW_S
        limiter.release(limiter.admit(tenant("probe"), "medium", 40, 0.0, clock.now), 30)

    start, end = retained_after(run, tenants)
    assert end - start < MIB, f"{(end - start) / MIB:.2f} MiB more after {tenants} tenants"
    assert list(limiter.tenants) == ["probe"] and len(limiter.seen) == 1


def test_forgetting_never_lets_a_limited_tenant_past_its_window_or_its_streams():
    limiter = Limiter()
    capped = Tenant("capped", rpm=2, max_concurrent=1)
    limiter.release(limiter.admit(capped, "medium", 1, 0.0, 0.0), 1)
    held = limiter.admit(capped, "medium", 1, 0.0, 1.0)          # its stream stays open
    for i in range(5_000):                                         # others come and go for minutes
        limiter.release(limiter.admit(Tenant(f"t{i}"), "medium", 1, 0.0, 2.0 + i * 0.05), 1)
    now = 2.0 + 5_000 * 0.05
    with pytest.raises(ServiceError) as refused:
        limiter.admit(capped, "medium", 1, 0.0, now)              # the window has passed, not the stream
    assert refused.value.reason == "rate_limit_concurrency"
    limiter.release(held, 1)
    limiter.release(limiter.admit(capped, "medium", 1, 0.0, now), 1)
    for i in range(2_000):                                         # 50 s more of others
        limiter.release(limiter.admit(Tenant(f"u{i}"), "medium", 1, 0.0, now + i * 0.025), 1)
    limiter.release(limiter.admit(capped, "medium", 1, 0.0, now + 50.0), 1)
    with pytest.raises(ServiceError) as refused:                  # rpm 2: the third within 60 s
        limiter.admit(capped, "medium", 1, 0.0, now + 55.0)
    assert refused.value.kind is ErrorKind.EXHAUSTED and refused.value.reason == "rate_limit_requests"
    assert len(limiter.tenants) <= 2 * 60 / 0.05                  # the last minute's tenants, not 5,000


class Snapshot:
    """A store's snapshot (keys, tenants, spent, stored): it holds every tenant ever billed."""

    def __init__(self, tenants: list[Tenant], spent: dict[str, float]):
        self.tenants, self.spent = tenants, spent

    def snapshot(self):
        return {}, self.tenants, self.spent, {}


def test_the_tenant_book_keeps_spending_only_for_tenants_with_a_budget():
    capped = Tenant("capped", budget=100.0)
    store = Snapshot([capped, Tenant("known")], {f"t{i}": 1.0 for i in range(10_000)} | {"capped": 5.0})
    book = TenantBook(store)
    asyncio.run(book.refresh())
    for i in range(10_000):                                        # billed, but nothing reads it
        book.release(Pass(Caller(Tenant(f"new{i}"))), None, 1.5)
    book.release(Pass(Caller(capped)), None, 2.0)
    assert book.spent == {"capped": 7.0}
    store.spent["capped"] = 6.0                                    # the ledger has not written the 2.0 yet
    asyncio.run(book.refresh())
    assert book.spent == {"capped": 7.0}
    with pytest.raises(ServiceError) as refused:
        book.admit(Caller(replace(capped, budget=7.0)), MEDIUM, 1)
    assert refused.value.reason == "insufficient_quota"


def series(registry: CollectorRegistry) -> int:
    return sum(len(metric.samples) for metric in registry.collect())


@pytest.mark.parametrize("tenants", TENANTS)
def test_the_router_tally_forgets_tenants_and_no_metric_is_labelled_by_tenant(tenants, monkeypatch):
    # What is bounded but not per tenant (latency samples, the console's minute) is made small,
    # so that the warm-up fills it.
    monkeypatch.setattr(tally, "LATENCY_WINDOW", 500)
    monkeypatch.setattr(tally, "FINISHED_WINDOW", 1_000)
    clock, registry = Clock(), CollectorRegistry()
    totals = RouterTotals(["pool"], registry=registry)
    totals.clock = clock
    limited = ServiceError(ErrorKind.EXHAUSTED, "over", reason="rate_limit_requests")
    tokens = common_pb2.GenerateChunk(token_ids=[1, 2, 3])
    done = common_pb2.GenerateChunk(finish_reason=common_pb2.FINISH_REASON_STOP,
                                    usage=common_pb2.Usage(prompt_tokens=5, completion_tokens=3))

    def run(prefix: str, n: int) -> None:
        for i in range(n):      # 100 new tenants a second: 60,000 inside the idle time, 10,000 kept
            tenant = f"{prefix}{i}"
            if i % 10 == 0:
                totals.refused_early(limited, MEDIUM, tenant)
            request = totals.start(ORDER[i % 3], tenant, INVALID_SPAN, f"r{i}")
            request.on_routed("pool")
            request.on_chunk(tokens)
            request.on_done(done)
            clock.now += 0.01
        clock.now += ROW_IDLE_S
        totals.start(MEDIUM, "probe", INVALID_SPAN).on_cancel()

    start, end = retained_after(run, tenants)
    assert end - start < MIB, f"{(end - start) / MIB:.2f} MiB more after {tenants} tenants"
    assert list(totals.by_tenant) == ["probe"] and not totals.limits_hit and len(totals.tenant_seen) == 1
    assert totals.by_priority[MEDIUM].requests > tenants / 3     # what is not per tenant is all there
    labels = {label for metric in registry.collect() for sample in metric.samples for label in sample.labels}
    assert "tenant" not in labels, labels
    before = series(registry)
    run("again", 1_000)
    assert series(registry) == before                            # new tenants: no new series


@pytest.mark.parametrize("tenants", TENANTS)
def test_the_fair_queues_forget_tenants_once_they_are_idle(tenants):
    # Through the policy, as the planner drives it: a request is queued, admitted (it leaves the
    # queue), charged for what it is served while it runs, and ends; each runs for the next 50
    # arrivals, and the tenants running are seen running. (50 request objects take turns: the
    # queues keep nothing of a request, only of its tenant. Their names are not interned as
    # request.py does: CPython's table of interned names keeps the size of its peak, and when it
    # next resizes depends on every name the process holds, not on these.) 100 new tenants a
    # second: 6,000 inside the idle time, reached in the warm-up.
    policy, clock = create_policy("qos", QoSSettings()), Clock()
    queues = [policy.queue(lane) for lane in policy.lanes]
    running = deque(Request(request_id=f"r{i}", seq_id=i, priority=ORDER[i % 3], tenant="", prompt_ids=[1, 2],
                            sampling=SamplingParams(max_tokens=4), detokenizer=None) for i in range(50))

    def run(prefix: str, n: int) -> None:
        for i in range(n):
            request = running.popleft()             # the oldest ends; its object is the next arrival
            request.tenant = f"{prefix}{i}"
            request.phase = Phase.WAITING
            policy.add(request)
            policy.remove(request)
            request.phase = Phase.RUNNING
            running.append(request)
            policy.charge_tenants(policy.lane_of(request), {request.tenant: 3})
            clock.now += 0.01
            policy.forget_idle_tenants(clock.now, [running])
        for request in running:
            request.tenant = ""
        clock.now += QUEUE_IDLE_S + TENANT_SWEEP_S
        policy.forget_idle_tenants(clock.now, [])

    start, end = retained_after(run, tenants, warm=10_000)
    assert end - start < MIB, f"{(end - start) / MIB:.2f} MiB more after {tenants} tenants"
    assert [q.tenants_known() for q in queues] == [0, 0, 0]


def test_the_batcher_forgets_the_tenants_it_served_once_they_are_idle():
    h = Harness(max_running=64, max_step_tokens=256)
    clock = Clock()
    h.batcher.clock = clock
    for wave in range(20):
        for i in range(100):
            h.submit(ORDER[i % 3], prompt_len=4, max_tokens=2, tenant=f"t{wave}-{i}")
        h.run_until_all_finished(max_steps=200)
        clock.now += 1.0
    assert all(r.phase is Phase.FINISHED for r in h.requests)
    queues = [h.policy.queue(lane) for lane in h.policy.lanes]
    assert sum(q.tenants_known() for q in queues) >= 60 * 3     # the last minute's tenants, not yet idle
    clock.now += QUEUE_IDLE_S
    h.step()                                                     # nothing to do: the loop still looks
    assert [q.tenants_known() for q in queues] == [0, 0, 0]


def test_tenants_that_wait_or_run_are_never_forgotten_however_fast_time_goes():
    # test_tenant_fairness's decode charging, with 61 s passing at every step: a's three running
    # sequences (nothing of a's waiting) keep a's virtual time, so b's next request still goes first.
    h = Harness(max_running=4, max_step_tokens=256)
    clock = Clock()
    h.batcher.clock = clock
    for _ in range(3):
        h.submit(LOW, prompt_len=10, max_tokens=300, tenant="a")
    b_running = h.submit(LOW, prompt_len=100, max_tokens=100, tenant="b")
    h.step()
    a_next = h.submit(LOW, prompt_len=10, max_tokens=5, tenant="a")
    b_next = h.submit(LOW, prompt_len=10, max_tokens=5, tenant="b")
    while b_running.phase is not Phase.FINISHED:
        clock.now += QUEUE_IDLE_S + 1
        h.step()
    clock.now += QUEUE_IDLE_S + 1
    h.step()
    assert b_next.output_ids and not a_next.output_ids


def test_backlogged_tenants_keep_their_weights_however_fast_time_goes():
    h = Harness(max_running=8, max_step_tokens=64)
    clock = Clock()
    h.batcher.clock = clock
    for _ in range(60):
        h.submit(LOW, prompt_len=30, max_tokens=200, tenant="heavy", weight=3.0)
        h.submit(LOW, prompt_len=30, max_tokens=200, tenant="light", weight=1.0)
    for _ in range(400):
        clock.now += QUEUE_IDLE_S + 1
        h.step()
    served = {t: sum(len(r.output_ids) + r.computed for r in h.requests if r.tenant == t)
              for t in ("heavy", "light")}
    assert abs(served["heavy"] / (served["heavy"] + served["light"]) - 0.75) <= 0.08, served
