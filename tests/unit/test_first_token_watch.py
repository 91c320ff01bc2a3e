"""The intake yields to first tokens (services/common/first_token_watch.py with
services/common/intake.py): while a High request waits for its first token, Medium and Low
admissions wait, at most max_hold_s from when that wait began; High is never held; the FCFS
baseline never holds; a waiter ends once however often it is told."""
from __future__ import annotations

import asyncio

from services.common.first_token_watch import FirstTokenWatch
from services.common.intake import PriorityIntake
from services.common.priority import HIGH, LOW, MEDIUM


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=10))


def yielding_intake(watch: FirstTokenWatch, order: list, loop_times: dict, by_priority: bool = True):
    """An intake that yields to `watch`, recording what it admits in `order` and when (loop time)."""
    async def admit(name):
        order.append(name)
        loop_times[name] = asyncio.get_running_loop().time()
        return name
    return PriorityIntake(admit, by_priority=by_priority, yield_to=watch, express_rank=HIGH, pause_s=0)


def test_lower_classes_wait_for_a_pending_first_token_and_go_once_it_comes():
    order, at = [], {}

    async def scenario():
        watch = FirstTokenWatch(max_hold_s=5.0)
        intake = yielding_intake(watch, order, at)
        task = asyncio.create_task(intake.run())
        waiter = watch.waiter()                 # a High request waits for its first token
        low = asyncio.ensure_future(intake.admit("low", LOW))
        medium = asyncio.ensure_future(intake.admit("medium", MEDIUM))
        await asyncio.sleep(0.05)
        assert order == [] and watch.holding()
        high = await intake.admit("high", HIGH)     # High is not held
        assert high == "high" and order == ["high"]
        first_token = asyncio.get_running_loop().time()
        waiter.done()                           # its first token came
        await asyncio.gather(low, medium)
        task.cancel()
        assert order == ["high", "medium", "low"]
        assert at["medium"] >= first_token and at["low"] >= first_token
        assert watch.holds >= 1 and watch.held_s > 0.04
        assert watch.waiting == 0 and not watch.holding()

    run(scenario())


def test_a_hold_runs_out_after_max_hold_s_even_while_high_requests_keep_waiting():
    order, at = [], {}

    async def scenario():
        watch = FirstTokenWatch(max_hold_s=0.05)
        intake = yielding_intake(watch, order, at)
        task = asyncio.create_task(intake.run())
        began = asyncio.get_running_loop().time()
        first = watch.waiter()
        second = watch.waiter()                 # overlapping High requests
        first.done()
        lows = [asyncio.ensure_future(intake.admit(f"low{i}", LOW)) for i in range(3)]
        await asyncio.gather(*lows)             # admitted although `second` still waits
        task.cancel()
        assert order == ["low0", "low1", "low2"]
        assert at["low0"] - began >= 0.045
        assert watch.waiting == 1 and not watch.holding()
        second.done()

    run(scenario())


def test_nothing_is_held_without_a_waiting_first_token_or_with_the_hold_off_or_in_fcfs():
    async def admitted_within(watch: FirstTokenWatch, by_priority: bool, waiting: bool) -> float:
        order, at = [], {}
        intake = yielding_intake(watch, order, at, by_priority)
        task = asyncio.create_task(intake.run())
        waiter = watch.waiter() if waiting else None
        began = asyncio.get_running_loop().time()
        await intake.admit("low", LOW)
        task.cancel()
        if waiter is not None:
            waiter.done()
        return at["low"] - began

    async def scenario():
        assert await admitted_within(FirstTokenWatch(5.0), True, waiting=False) < 0.5
        assert await admitted_within(FirstTokenWatch(0.0), True, waiting=True) < 0.5
        assert await admitted_within(FirstTokenWatch(5.0), False, waiting=True) < 0.5

    run(scenario())


def test_a_waiter_counts_once_however_often_it_is_done():
    async def scenario():
        watch = FirstTokenWatch(1.0)
        a, b = watch.waiter(), watch.waiter()
        a.done()
        a.done()                    # at the first token, and again when the request ends
        assert watch.waiting == 1 and watch.holding()
        b.done()
        assert watch.waiting == 0 and not watch.holding()
        fresh = watch.waiter()      # a new wait starts a new hold
        assert watch.holding()
        fresh.done()

    run(scenario())


def test_its_metrics_say_how_often_and_how_long_the_intake_yielded():
    async def scenario():
        watch = FirstTokenWatch(0.02)
        waiter = watch.waiter()
        await watch.hold()          # runs out after 20 ms
        waiter.done()
        return {m.name: m.samples[0].value for m in watch.metrics()}

    values = run(scenario())
    assert values["qos_first_token_waiting"] == 0
    assert values["qos_first_token_holds"] == 1
    assert 0.015 <= values["qos_first_token_held_seconds"] < 1.0


def test_a_high_request_queued_during_a_hold_is_admitted_without_waiting_for_it():
    """In the scheduler a long High prompt is tokenized in a thread: a second High request then
    queues behind it. If the intake is holding Low meanwhile, the second goes as soon as the first
    is admitted, not when the hold ends."""
    order, at = [], {}
    release_first = None

    async def scenario():
        nonlocal release_first
        release_first = asyncio.Event()

        async def admit(name):
            if name == "high1":
                await release_first.wait()      # tokenizing a long prompt
            order.append(name)
            at[name] = asyncio.get_running_loop().time()
            return name

        watch = FirstTokenWatch(max_hold_s=5.0)
        intake = PriorityIntake(admit, yield_to=watch, express_rank=HIGH, pause_s=0)
        task = asyncio.create_task(intake.run())
        waiter = watch.waiter()                 # high1 waits for its first token
        high1 = asyncio.ensure_future(intake.admit("high1", HIGH))     # admitted in its handler
        await asyncio.sleep(0)
        low = asyncio.ensure_future(intake.admit("low", LOW))
        await asyncio.sleep(0.05)               # the intake holds Low
        high2 = asyncio.ensure_future(intake.admit("high2", HIGH))     # queued behind high1
        await asyncio.sleep(0.02)
        release_first.set()
        began = asyncio.get_running_loop().time()
        await asyncio.gather(high1, high2)
        assert at["high2"] - began < 1.0 and order == ["high1", "high2"]
        assert not low.done()                   # still held: high1's first token has not come
        waiter.done()
        await low
        task.cancel()
        assert order == ["high1", "high2", "low"]

    run(scenario())
