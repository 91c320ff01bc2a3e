"""Priority admission (services/common/intake.py): High goes first through a backlog, the FCFS
baseline keeps arrival order, a refusal reaches only its own request, a caller that goes away is
skipped, and the server gets its turns while a backlog is admitted."""
from __future__ import annotations

import asyncio

import pytest

from services.common.intake import PriorityIntake

from services.common.priority import HIGH, LOW, MEDIUM


class Refused(Exception):
    pass


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=10))


def admitting(function):
    """An async admit function from a plain one (the scheduler's also awaits its tokenizer)."""
    async def admit(name):
        return function(name)
    return admit


async def admit_all(intake: PriorityIntake, requests: list[tuple[str, int]]) -> list:
    """Queue every request before the admitting task starts, then admit them all."""
    waiters = [asyncio.ensure_future(intake.admit(name, priority)) for name, priority in requests]
    await asyncio.sleep(0)          # every waiter is queued now
    task = asyncio.create_task(intake.run())
    try:
        return await asyncio.gather(*waiters, return_exceptions=True)
    finally:
        task.cancel()


def test_backlog_is_admitted_highest_priority_first_then_in_arrival_order():
    order = []
    intake = PriorityIntake(admitting(lambda name: order.append(name) or name.upper()))
    results = run(admit_all(intake, [("low1", LOW), ("med1", MEDIUM), ("low2", LOW),
                                     ("high1", HIGH), ("med2", MEDIUM), ("high2", HIGH)]))
    assert order == ["high1", "high2", "med1", "med2", "low1", "low2"]
    assert results == ["LOW1", "MED1", "LOW2", "HIGH1", "MED2", "HIGH2"]   # each caller gets its own


def test_fcfs_intake_keeps_arrival_order():
    order = []
    intake = PriorityIntake(admitting(order.append), by_priority=False)
    run(admit_all(intake, [("low1", LOW), ("high1", HIGH), ("med1", MEDIUM)]))
    assert order == ["low1", "high1", "med1"]


def test_a_refusal_reaches_only_its_own_request():
    def admit(name):
        if name == "bad":
            raise Refused(name)
        return name

    results = run(admit_all(PriorityIntake(admitting(admit)), [("a", LOW), ("bad", LOW), ("b", LOW)]))
    assert results[0] == "a" and results[2] == "b"
    assert isinstance(results[1], Refused)


def test_a_cancelled_waiter_is_never_admitted():
    order = []

    async def scenario():
        intake = PriorityIntake(admitting(order.append))
        gone = asyncio.ensure_future(intake.admit("gone", HIGH))
        kept = asyncio.ensure_future(intake.admit("kept", LOW))
        await asyncio.sleep(0)
        gone.cancel()
        task = asyncio.create_task(intake.run())
        await kept
        task.cancel()
        assert len(intake) == 0
        with pytest.raises(asyncio.CancelledError):
            await gone

    run(scenario())
    assert order == ["kept"]


def test_a_high_request_arriving_during_a_backlog_overtakes_it():
    """The case the module exists for: Low requests are being admitted one by one when a High one
    arrives; it is admitted next, not after the rest of the backlog."""
    order = []

    async def scenario():
        intake = PriorityIntake(admitting(order.append))
        task = asyncio.create_task(intake.run())
        lows = [asyncio.ensure_future(intake.admit(f"low{i}", LOW)) for i in range(20)]
        while not order:                 # the first Low is admitted, 19 still wait
            await asyncio.sleep(0)
        await intake.admit("high", HIGH)
        await asyncio.gather(*lows)
        task.cancel()

    run(scenario())
    assert order.index("high") <= 2, order
    assert [name for name in order if name != "high"] == [f"low{i}" for i in range(20)]


def test_a_high_request_is_admitted_while_a_low_admission_is_still_in_progress():
    """A Low admission that takes long (the scheduler tokenizing a 4,000-token prompt in its
    thread) does not hold a High one back; the next Low waits for it (one per class at a time)."""
    started, finished = [], []

    async def scenario():
        low_tokenized = asyncio.Event()

        async def admit(name):
            started.append(name)
            if name == "low1":
                await low_tokenized.wait()
            finished.append(name)
            return name

        intake = PriorityIntake(admit)
        task = asyncio.create_task(intake.run())
        lows = [asyncio.ensure_future(intake.admit(name, LOW)) for name in ("low1", "low2")]
        while not started:
            await asyncio.sleep(0)
        assert await intake.admit("high", HIGH) == "high"      # low1 is still being admitted
        assert started == ["low1", "high"] and finished == ["high"]
        low_tokenized.set()
        assert await asyncio.gather(*lows) == ["low1", "low2"]
        task.cancel()

    run(scenario())
    assert finished == ["high", "low1", "low2"]


def test_admissions_in_progress_end_with_the_intake():
    cancelled = []

    async def scenario():
        async def admit(name):
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(name)
                raise

        intake = PriorityIntake(admit)
        task = asyncio.create_task(intake.run())
        waiter = asyncio.ensure_future(intake.admit("low", LOW))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):    # its caller is not left waiting
            await asyncio.wait_for(waiter, 2)

    run(scenario())
    assert cancelled == ["low"]


def test_a_high_request_with_none_of_its_class_ahead_is_admitted_in_its_own_handler():
    """express_rank: High skips the queue (and the admitting task's turns of the event loop) when
    no High request waits or is being admitted; Low's backlog does not wait for it to be served."""
    order = []

    async def scenario():
        intake = PriorityIntake(admitting(order.append), express_rank=HIGH)
        low = asyncio.ensure_future(intake.admit("low", LOW))
        await asyncio.sleep(0)
        # No admitting task is running: only the express path can admit it.
        await asyncio.wait_for(intake.admit("high", HIGH), 1)
        assert order == ["high"] and len(intake) == 1
        task = asyncio.create_task(intake.run())
        await low
        task.cancel()

    run(scenario())
    assert order == ["high", "low"]


def test_a_high_request_behind_another_being_admitted_waits_its_turn():
    """One admission per class at a time holds for the express path too: the second High request
    queues while the first is admitted (tokenized), then the admitting task takes it."""
    started, finished = [], []

    async def scenario():
        first_tokenized = asyncio.Event()

        async def admit(name):
            started.append(name)
            if name == "high1":
                await first_tokenized.wait()
            finished.append(name)
            return name

        intake = PriorityIntake(admit, express_rank=HIGH)
        task = asyncio.create_task(intake.run())
        first = asyncio.ensure_future(intake.admit("high1", HIGH))
        while not started:
            await asyncio.sleep(0)
        second = asyncio.ensure_future(intake.admit("high2", HIGH))
        await asyncio.sleep(0.01)
        assert started == ["high1"] and len(intake) == 1
        first_tokenized.set()
        assert await asyncio.gather(first, second) == ["high1", "high2"]
        task.cancel()

    run(scenario())
    assert finished == ["high1", "high2"]


def test_the_fcfs_intake_has_no_express_class():
    order = []

    async def scenario():
        intake = PriorityIntake(admitting(order.append), by_priority=False, express_rank=HIGH)
        high = asyncio.ensure_future(intake.admit("high", HIGH))
        await asyncio.sleep(0.01)
        assert order == [] and len(intake) == 1     # queued like every other request
        task = asyncio.create_task(intake.run())
        await high
        task.cancel()

    run(scenario())
    assert order == ["high"]
