"""A stream's logprobs across a failover and a migration: one entry per token it streams, each
the one computed for that token (its position), none repeated and none lost (simulated workers)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

from services.common.errors import ServiceError
from services.common.step import SamplingParams
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.policy import create_policy
from services.scheduler.request import resume
from tests.unit.detok_helpers import load_text_tokenizer
from tests.unit.test_batcher import SimulatedWorker, drain, expected_output, make_request


def asking(seq_id: int, max_tokens: int = 30):
    request = make_request(seq_id, prompt_len=8 + seq_id, max_tokens=max_tokens)
    request.sampling = replace(request.sampling, logprobs=0)
    request.detokenizer = IncrementalDetokenizer(load_text_tokenizer().tokenizer, request.prompt_ids)
    return request


async def collect(request):
    entries, tokens = [], []
    while True:
        event = await request.events.get()
        assert not isinstance(event, ServiceError), event.message
        tokens.extend(event.token_ids)
        entries.extend(event.logprobs)
        if event.finish_reason:
            return tokens, entries


def check(request, tokens, entries, first_output: int = 0):
    prompt = len(request.prompt_ids)
    assert [e.token_id for e in entries] == tokens                       # one per token, in order
    # token k of the output was sampled after position prompt + k - 1: no entry repeated or lost
    assert [e.logprob for e in entries] == [-(prompt + k) / 8 for k in range(first_output, first_output + len(tokens))]


def test_logprobs_continue_exactly_after_a_worker_fails():
    async def scenario():
        workers = [SimulatedWorker(0, 64), SimulatedWorker(1, 64)]
        batcher = ContinuousBatcher("sim", workers, create_policy("qos"), 8, 32)
        loop = asyncio.create_task(batcher.run())
        requests = [asking(i) for i in range(6)]
        for r in requests:
            batcher.submit(r)
        firsts = [await r.events.get() for r in requests]
        moved = [r for r in requests if r.worker == 0]
        workers[0].fail_next = True
        try:
            rests = await asyncio.wait_for(asyncio.gather(*(collect(r) for r in requests)), 10)
        finally:
            loop.cancel()
        return requests, moved, firsts, rests

    requests, moved, firsts, rests = asyncio.run(scenario())
    assert moved and all(r.failovers for r in moved)
    for request, first, (tokens, entries) in zip(requests, firsts, rests):
        tokens, entries = list(first.token_ids) + tokens, list(first.logprobs) + entries
        assert tokens == expected_output(request)
        check(request, tokens, entries)


def test_a_migrated_request_gets_entries_only_for_what_it_generates_here():
    async def scenario():
        batcher = ContinuousBatcher("sim", [SimulatedWorker(0, 64)], create_policy("qos"), 8, 32)
        loop = asyncio.create_task(batcher.run())
        request = asking(3)
        streamed = expected_output(request)[:7]        # what the first pool streamed, with their logprobs
        resume(request, list(streamed), 49152)
        batcher.submit(request)
        try:
            return request, streamed, await asyncio.wait_for(collect(request), 10)
        finally:
            loop.cancel()

    request, streamed, (tokens, entries) = asyncio.run(scenario())
    assert streamed + tokens == expected_output(request)
    check(request, tokens, entries, first_output=len(streamed))
