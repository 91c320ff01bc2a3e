"""Run-time membership (services/scheduler/membership.py) over simulated workers and a stub DNS
resolver whose answers change: new addresses join and take work, vanished ones leave and their
sequences finish on the others, registered workers that stay away are forgotten."""
from __future__ import annotations

import asyncio

from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.membership import Membership
from services.scheduler.policy import create_policy
from tests.unit.test_batcher import SimulatedWorker, drain, expected_output, make_request


class Link(SimulatedWorker):
    """A simulated worker with a link's lifecycle, made by address as WorkerLink is."""

    def __init__(self, index: int, address: str):
        super().__init__(index, 64)
        self.address = address
        self.closed = False

    async def keep_connected(self) -> None:
        await asyncio.Event().wait()          # always connected until closed

    async def close(self) -> None:
        self.closed = True
        self.pool = None


class StubDNS:
    def __init__(self, *answers: list[str]):
        self.answers = list(answers)
        self.asked = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        assert (host, port) == ("qos-workers.ns.svc", 50053)
        self.asked += 1
        answer = self.answers[min(self.asked - 1, len(self.answers) - 1)]
        if isinstance(answer, Exception):
            raise answer
        return [f"{ip}:{port}" for ip in answer]


def membership(dns: StubDNS, **options) -> tuple[ContinuousBatcher, Membership]:
    batcher = ContinuousBatcher("sim", [], create_policy("qos"), 8, 32)
    return batcher, Membership(batcher, link_factory=Link, resolver=dns, **options)


def test_dns_answers_add_and_drain_workers_and_sequences_finish_elsewhere():
    dns = StubDNS(["10.0.0.1"], ["10.0.0.1", "10.0.0.2"], OSError("SERVFAIL"), ["10.0.0.2"])

    async def scenario():
        batcher, members = membership(dns)
        loop = asyncio.create_task(batcher.run())
        await members.sync_dns("qos-workers.ns.svc", 50053)
        assert [l.address for l in batcher.links] == ["10.0.0.1:50053"]
        await members.sync_dns("qos-workers.ns.svc", 50053)
        assert [l.address for l in batcher.links] == ["10.0.0.1:50053", "10.0.0.2:50053"]
        requests = [make_request(i, prompt_len=6 + i, max_tokens=30) for i in range(8)]
        for r in requests:
            batcher.submit(r)
        firsts = [await r.events.get() for r in requests]
        first = members.links["10.0.0.1:50053"]
        leaving = [r for r in requests if r.worker == first.index]
        await members.sync_dns("qos-workers.ns.svc", 50053)      # no answer: nobody leaves
        assert len(batcher.links) == 2
        await members.sync_dns("qos-workers.ns.svc", 50053)      # 10.0.0.1 is gone
        results = await asyncio.wait_for(asyncio.gather(*(drain(r) for r in requests)), 10)
        loop.cancel()
        await members.stop()
        return batcher, first, requests, leaving, firsts, results

    batcher, first, requests, leaving, firsts, results = asyncio.run(scenario())
    assert first.closed and leaving, "the worker that left held no sequence"
    assert [l.address for l in batcher.links] == ["10.0.0.2:50053"]
    for request, first_chunk, (tokens, _, last) in zip(requests, firsts, results):
        assert list(first_chunk.token_ids) + tokens == expected_output(request)
    assert all(r.failovers[0][1] == "left" for r in leaving)
    assert batcher.failovers["left"] == len(leaving)


def test_registration_is_idempotent_and_the_unreachable_are_forgotten_but_not_configured_ones():
    async def scenario():
        batcher, members = membership(StubDNS([]), forget_after_s=30)
        members.start(["10.0.0.9:50053"], None)
        assert members.register("10.0.0.5:50053") is False
        assert members.register("10.0.0.5:50053") is True
        for link in batcher.links:
            link.pool = None                  # both unreachable
        await members.forget_unreachable(now=100.0)
        await members.forget_unreachable(now=120.0)
        kept_at_20s = sorted(l.address for l in batcher.links)
        await members.forget_unreachable(now=131.0)
        left = sorted(l.address for l in batcher.links)
        await members.stop()
        return kept_at_20s, left

    kept_at_20s, left = asyncio.run(scenario())
    assert kept_at_20s == ["10.0.0.5:50053", "10.0.0.9:50053"]
    assert left == ["10.0.0.9:50053"]
