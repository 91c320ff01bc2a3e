"""A request's n choices merged (services/router/openai_api/choices.py), with streams standing in for the
request path: nothing passes before every choice has started, an error or a cancelled choice ends
them all (every stream closed), the consumer going away closes them, and each choice's request
carries its own id and seed."""
from __future__ import annotations

import asyncio

import pytest

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import MEDIUM
from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.router.openai_api.choices import SEEDS, choice_body, choice_heads, merged, one_choice
from services.router.validation import RequestHead

FINISH = common_pb2.FINISH_REASON_LENGTH


class Choice:
    """A stream of scripted steps: ("chunk", text, finish) or ("wait", event) or ("raise", error)."""

    def __init__(self, *steps):
        self.steps, self.closed, self.task = steps, False, None

    async def stream(self):
        self.task = asyncio.current_task()
        try:
            for step in self.steps:
                if step[0] == "wait":
                    await step[1].wait()
                elif step[0] == "raise":
                    raise step[1]
                else:
                    yield common_pb2.GenerateChunk(text=step[1], finish_reason=step[2])
        finally:
            self.closed = True


def heads(n: int, total: int | None = None) -> list[RequestHead]:
    return choice_heads(RequestHead(MEDIUM, request_id="r"), n, total or n)


async def collect(choices, stop_after=None, got=None):
    got = [] if got is None else got
    stream = merged([c.stream() for c in choices], heads(len(choices)))
    try:
        async for item in stream:
            got.append((item[0], item[1].text))
            if stop_after is not None and len(got) == stop_after:
                break
    finally:
        await stream.aclose()
    return got


def test_nothing_passes_until_every_choice_has_started_then_chunks_come_as_they_arrive():
    async def go():
        late = asyncio.Event()
        early = Choice(("chunk", "a", 0), ("chunk", "b", 0), ("chunk", "c", FINISH))
        slow = Choice(("wait", late), ("chunk", "x", 0), ("chunk", "y", FINISH))
        got = []
        task = asyncio.create_task(collect([early, slow], got=got))
        await asyncio.sleep(0.05)
        assert got == [] and early.closed         # choice 0 ended, held back
        late.set()
        return await task

    got = asyncio.run(go())
    assert got[:3] == [(0, "a"), (0, "b"), (0, "c")] and got[3:] == [(1, "x"), (1, "y")]


def test_an_error_before_every_choice_started_is_the_requests_and_closes_the_others():
    async def go():
        never = asyncio.Event()
        waiting = Choice(("chunk", "a", 0), ("wait", never), ("chunk", "b", FINISH))
        refused = Choice(("raise", ServiceError(ErrorKind.EXHAUSTED, "rpm", reason="rate_limit")),)
        with pytest.raises(ServiceError) as caught:
            await collect([waiting, refused])
        return caught.value, waiting

    error, waiting = asyncio.run(go())
    assert error.reason == "rate_limit" and waiting.closed


def test_a_choice_cancelled_by_its_id_cancels_the_request():
    async def go():
        never = asyncio.Event()
        choices = [Choice(("chunk", "a", 0), ("wait", never)) for _ in range(3)]
        task = asyncio.create_task(collect(choices))
        await asyncio.sleep(0.05)
        choices[2].task.cancel()            # what Accounts.cancel does to the task that admitted it
        with pytest.raises(ServiceError) as caught:
            await asyncio.wait_for(task, 10)
        return caught.value, choices

    error, choices = asyncio.run(go())
    assert error.kind is ErrorKind.CANCELLED and "r-2" in error.message
    assert all(c.closed for c in choices)


def test_the_consumer_going_away_closes_every_choice():
    async def go():
        never = asyncio.Event()
        choices = [Choice(("chunk", "a", 0), ("chunk", "b", 0), ("wait", never)) for _ in range(2)]
        got = await collect(choices, stop_after=3)
        return got, choices

    got, choices = asyncio.run(go())
    assert len(got) == 3 and all(c.closed for c in choices)


def test_a_choice_ending_without_its_last_chunk_is_an_error():
    async def go():
        with pytest.raises(ServiceError) as caught:
            await collect([Choice(("chunk", "a", FINISH)), Choice(("chunk", "b", 0))])
        return caught.value

    assert asyncio.run(go()).reason == "truncated"


def test_each_choice_has_its_own_id_and_seed():
    ids = [(h.request_id, h.choice) for h in heads(3)]
    assert ids == [("r", 0), ("r-1", 1), ("r-2", 2)]
    # Two prompts of two choices each: ids run on, the choice index starts again with each prompt.
    assert [(h.request_id, h.choice) for h in heads(2, 4)] == [("r", 0), ("r-1", 1), ("r-2", 0), ("r-3", 1)]
    body = router_pb2.GenerateRequest(prompt="p")
    body.sampling.seed = SEEDS - 1
    assert [choice_body(body, i).sampling.seed for i in range(3)] == [SEEDS - 1, 0, 1]     # wraps
    unseeded = router_pb2.GenerateRequest(prompt="p")
    assert not choice_body(unseeded, 2).sampling.HasField("seed")
    copy = choice_body(body, 0)
    copy.model = "changed"
    assert body.model == ""                 # each choice's own copy
    ids = choice_body(body, 1, [5, 6])      # a batch's prompt replaces the body's own, of either kind
    assert (ids.prompt, list(ids.prompt_token_ids), ids.sampling.seed) == ("", [5, 6], 0)
    text = choice_body(ids, 0, "q")
    assert (text.prompt, list(text.prompt_token_ids)) == ("q", [])


def test_one_choice_closes_its_stream_when_it_is_closed():
    """The request path settles a request (and cancels it at its scheduler) when its stream is
    closed: closing the n = 1 wrapper must close it then, not when the garbage collector runs."""
    async def go():
        never = asyncio.Event()
        choice = Choice(("chunk", "a", 0), ("wait", never))
        wrapped = one_choice(choice.stream())
        assert await anext(wrapped) == (0, common_pb2.GenerateChunk(text="a"))
        await wrapped.aclose()
        return choice.closed

    assert asyncio.run(go())


def test_a_bug_in_one_choice_is_raised_not_waited_for():
    async def go():
        never = asyncio.Event()
        with pytest.raises(ZeroDivisionError):
            await asyncio.wait_for(collect([Choice(("chunk", "a", 0), ("wait", never)),
                                            Choice(("raise", ZeroDivisionError()),)]), 10)

    asyncio.run(go())
