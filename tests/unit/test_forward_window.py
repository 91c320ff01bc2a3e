"""The router's forward window (services/router/forward_window.py): per pool and class, at most
`size` requests in flight; the rest wait in arrival order, each taking the slot of one that
finished; exempt requests pass; a full queue is refused with the pool's retry-after; a request
whose client goes away while waiting leaves no trace."""
from __future__ import annotations

import asyncio

import pytest

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import HIGH, LOW, MEDIUM
from services.router.forward_window import ForwardWindows, PoolQueueLimit


class Request:
    """Goes through its turn, records when it got in, and stays in flight until told to finish."""

    def __init__(self, windows: ForwardWindows, log: list, name: str, priority: int = LOW,
                 pool: str = "cpu", exempt: bool = False, tenant: str = "", weight: float = 1.0):
        self.name = name
        self.done = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(windows, log, name, priority, pool, exempt, tenant, weight))

    async def _run(self, windows, log, name, priority, pool, exempt, tenant, weight):
        async with windows.turn(pool, priority, exempt, tenant, weight):
            log.append(name)
            await self.done.wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def windows(size: int = 2, max_queue: int = 100) -> ForwardWindows:
    return ForwardWindows(size, {"cpu": PoolQueueLimit(max_queue, 750), "gpu": PoolQueueLimit(max_queue, 750)})


def test_at_most_the_window_is_in_flight_and_the_rest_follow_in_arrival_order():
    async def scenario():
        w, log = windows(2), []
        requests = [Request(w, log, f"low{i}") for i in range(5)]
        await settle()
        assert log == ["low0", "low1"] and w.counts("cpu", LOW) == (2, 3) and w.held("cpu") == 3
        requests[1].done.set()
        await settle()
        assert log == ["low0", "low1", "low2"] and w.counts("cpu", LOW) == (2, 2)
        for r in requests:
            r.done.set()
        await asyncio.gather(*(r.task for r in requests))
        assert log == [f"low{i}" for i in range(5)] and w.counts("cpu", LOW) == (0, 0)
    asyncio.run(scenario())


def test_classes_and_pools_have_windows_of_their_own_and_exempt_requests_pass():
    async def scenario():
        w, log = windows(1), []
        requests = [Request(w, log, "low0"), Request(w, log, "low1"), Request(w, log, "medium0", MEDIUM),
                    Request(w, log, "low-gpu", pool="gpu"), Request(w, log, "high", HIGH, exempt=True),
                    Request(w, log, "low-slo", exempt=True)]
        await settle()
        assert log == ["low0", "medium0", "low-gpu", "high", "low-slo"]     # low1 waits for low0 only
        assert w.counts("cpu", LOW) == (1, 1) and w.counts("cpu", HIGH) == (0, 0)
        for r in requests:
            r.done.set()
        await asyncio.gather(*(r.task for r in requests))
        assert log[-1] == "low1"
    asyncio.run(scenario())


def test_a_class_whose_in_flight_and_held_reach_the_pools_queue_limit_is_refused_with_its_retry_after():
    async def scenario():
        w, log = windows(2, max_queue=4), []
        requests = [Request(w, log, f"low{i}") for i in range(4)]
        await settle()
        with pytest.raises(ServiceError) as refused:
            async with w.turn("cpu", LOW):
                pass
        assert refused.value.kind is ErrorKind.EXHAUSTED and refused.value.retry_after_ms == 750
        assert refused.value.reason == "queue_full" and "low queue of pool cpu is full (4 waiting)" in \
            refused.value.message
        async with w.turn("cpu", MEDIUM):          # another class still has room
            pass
        for r in requests:
            r.done.set()
        await asyncio.gather(*(r.task for r in requests))
    asyncio.run(scenario())


async def three_in_a_window_of_one() -> tuple[ForwardWindows, list, list[Request]]:
    w, log = windows(1), []
    requests = [Request(w, log, name) for name in ("first", "second", "third")]
    await settle()
    return w, log, requests


async def finish_last(w: ForwardWindows, last: Request) -> None:
    last.done.set()
    await last.task
    assert w.counts("cpu", LOW) == (0, 0)


def test_a_request_cancelled_while_held_or_in_flight_frees_its_place():
    async def scenario():
        w, log, (first, second, third) = await three_in_a_window_of_one()
        second.task.cancel()                       # its client went away while it waited
        await settle()
        assert w.counts("cpu", LOW) == (1, 1)
        first.task.cancel()                        # ... and one in flight
        await settle()
        assert log == ["first", "third"] and w.counts("cpu", LOW) == (1, 0)
        await finish_last(w, third)
    asyncio.run(scenario())


def test_a_slot_handed_to_a_request_cancelled_before_it_ran_goes_on_to_the_next():
    async def scenario():
        w, log, (first, second, third) = await three_in_a_window_of_one()
        first.done.set()
        await asyncio.sleep(0)                     # first's slot is handed to second ...
        second.task.cancel()                       # ... which is cancelled before it resumes
        await settle()
        assert log == ["first", "third"] and w.counts("cpu", LOW) == (1, 0)
        await finish_last(w, third)
    asyncio.run(scenario())


def test_size_zero_holds_nothing():
    async def scenario():
        w, log = windows(0), []
        requests = [Request(w, log, f"low{i}") for i in range(300)]
        await settle()
        assert len(log) == 300 and w.held("cpu") == 0
        for r in requests:
            r.done.set()
        await asyncio.gather(*(r.task for r in requests))
    asyncio.run(scenario())


def test_the_collector_reports_held_and_in_flight_per_pool_and_class():
    async def scenario():
        w, log = windows(1), []
        requests = [Request(w, log, f"low{i}") for i in range(3)] + [Request(w, log, "medium", MEDIUM)]
        await settle()
        samples = {(m.name, s.labels["pool"], s.labels["priority"]): s.value
                   for m in w.collect() for s in m.samples}
        for r in requests:
            r.done.set()
        await asyncio.gather(*(r.task for r in requests))
        return samples
    samples = asyncio.run(scenario())
    assert samples[("qos_router_held_requests", "cpu", "low")] == 2
    assert samples[("qos_router_window_in_flight", "cpu", "low")] == 1
    assert samples[("qos_router_held_requests", "cpu", "medium")] == 0


def test_tenants_take_turns_by_weight_so_one_tenants_flood_does_not_hold_anothers_request_back():
    async def scenario():
        w, log = windows(2), []
        flood = [Request(w, log, f"a{i}", tenant="a") for i in range(6)]
        await settle()
        late = [Request(w, log, "b0", tenant="b", weight=2.0), Request(w, log, "b1", tenant="b", weight=2.0),
                Request(w, log, "c0", tenant="c")]
        await settle()
        assert log == ["a0", "a1"] and w.counts("cpu", LOW) == (2, 7)
        order = []
        for _ in range(7):                       # finish the oldest in flight, one at a time
            running = [r for r in flood + late if r.task and not r.done.is_set() and r.name in log]
            running[0].done.set()
            await settle()
            order.append(log[-1])
        for r in flood + late:
            r.done.set()
        await asyncio.gather(*(r.task for r in flood + late))
        return order
    # a's two went straight through; then fair queueing over forwards: b (weight 2) twice, c once,
    # and only then a again, though a's four held requests arrived first.
    assert asyncio.run(scenario())[:4] == ["b0", "b1", "c0", "a2"]
