"""Workers failing, leaving and joining while streams run (pure Python, simulated workers): every
sequence on a lost worker is recomputed on another one and its stream continues exactly; only a
pool with no worker left hands requests back."""
from __future__ import annotations

import asyncio

from services.common.errors import ErrorKind, ServiceError
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.policy import create_policy
from tests.unit.test_batcher import SimulatedWorker, drain, expected_output, make_request


async def streaming(workers, count=6, max_tokens=40, orphan_grace_s=10.0):
    """A running loop over `workers` with `count` requests that have each streamed a token."""
    batcher = ContinuousBatcher("sim", workers, create_policy("qos"), 8, 32, orphan_grace_s=orphan_grace_s)
    loop = asyncio.create_task(batcher.run())
    requests = [make_request(i, prompt_len=8 + i, max_tokens=max_tokens) for i in range(count)]
    for r in requests:
        batcher.submit(r)
    firsts = [await r.events.get() for r in requests]
    return batcher, loop, requests, firsts


async def finish(requests, firsts, loop):
    try:
        results = await asyncio.wait_for(asyncio.gather(*(drain(r) for r in requests)), 10)
    finally:
        loop.cancel()
    return [(list(first.token_ids) + tokens, last) for first, (tokens, _, last) in zip(firsts, results)]


def test_a_failed_workers_sequences_finish_exactly_on_the_other():
    async def scenario():
        workers = [SimulatedWorker(0, 64), SimulatedWorker(1, 64)]
        batcher, loop, requests, firsts = await streaming(workers)
        on_first = [r for r in requests if r.worker == 0]
        workers[0].fail_next = True
        return batcher, workers, requests, on_first, await finish(requests, firsts, loop)

    batcher, workers, requests, moved, outcomes = asyncio.run(scenario())
    assert moved, "no sequence ran on the worker that failed"
    for request, (tokens, last) in zip(requests, outcomes):
        assert not isinstance(last, ServiceError)
        assert tokens == expected_output(request)        # no gap, no duplicate, same tokens
    assert all(len(r.failovers) == 1 and r.failovers[0][1] == "worker_failed" for r in moved)
    assert batcher.failovers["worker_failed"] == len(moved)
    assert workers[1].pool.num_used == 0 and not workers[1].table.sequences


def test_the_only_worker_back_within_the_grace_finishes_everything():
    async def scenario():
        worker = SimulatedWorker(0, 64)
        batcher, loop, requests, firsts = await streaming([worker])
        worker.fail_next = True
        await asyncio.sleep(0.3)                # the loop notices; nobody can serve for a while
        worker.restart()
        return requests, await finish(requests, firsts, loop)

    requests, outcomes = asyncio.run(scenario())
    assert all(tokens == expected_output(r) for r, (tokens, _) in zip(requests, outcomes))


def test_no_worker_left_after_the_grace_hands_requests_back():
    async def scenario():
        worker = SimulatedWorker(0, 64)
        batcher, loop, requests, firsts = await streaming([worker], orphan_grace_s=0.3)
        worker.fail_next = True
        return await finish(requests, firsts, loop)

    for _, last in asyncio.run(scenario()):
        assert isinstance(last, ServiceError) and last.kind is ErrorKind.UNAVAILABLE
        assert last.reason == "no_worker" and "has no worker left" in last.message


def test_a_worker_that_leaves_hands_its_sequences_to_the_others_and_a_new_one_takes_work():
    async def scenario():
        workers = [SimulatedWorker(0, 64), SimulatedWorker(1, 64)]
        batcher, loop, requests, firsts = await streaming(workers)
        leaving = [r for r in requests if r.worker == 0]
        batcher.remove_link(workers[0], "worker sim-0 is gone from DNS")
        joined = SimulatedWorker(2, 64)
        batcher.add_link(joined)
        late = [make_request(10 + i, prompt_len=5, max_tokens=30) for i in range(6)]
        for r in late:
            batcher.submit(r)
        firsts += [await r.events.get() for r in late]
        return batcher, joined, requests + late, leaving, await finish(requests + late, firsts, loop)

    batcher, joined, requests, leaving, outcomes = asyncio.run(scenario())
    assert leaving and all(r.failovers[0][1] == "left" for r in leaving)
    assert all(tokens == expected_output(r) for r, (tokens, _) in zip(requests, outcomes))
    assert [link.address for link in batcher.links] == ["sim-1", "sim-2"]
    assert any(p.new_sequences for p in joined.plans), "the worker that joined got no work"
    assert joined.pool.num_used == 0
