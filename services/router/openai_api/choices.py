"""A request with n choices (OpenAI's `n`), or a batch of prompts (completions' `prompt` as a
list, n choices each): one request a choice on the shared path, their chunks merged into one
answer, each tagged with its choice's index (prompt by prompt, as OpenAI orders them).

Why a request a choice: each choice is a sequence of its own in its pool (its own sampling, stream,
preemption and failover, as any request's), and the choices share the prompt through the prefix
cache: they arrive together with one prefix, so the pool computes it once and the others wait for
it (services/scheduler/prefix_in_flight.py), as vLLM's parallel sampling does. Choice g is request
`ID-g` (choice 0 is `ID` itself, the X-Request-Id); a prompt's i-th choice is seeded with seed + i
when the request names a seed (vLLM's rule: the choices differ, and each is reproducible alone).
Each prompt is billed once, with its first choice (accounts.billed_prompt); each choice counts
against its tenant's limits as a request.

All or nothing: nothing is passed on until every choice has sent its first chunk, so a refusal of
any (a limit, a bad value) is the request's status and no tokens went out; after that an error in
one choice ends the others and the request. Cancelling any choice's id cancels the request.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from services.common.errors import ErrorKind, ServiceError, unavailable
from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.router.openai_api.prompt import set_prompt
from services.router.validation import RequestHead

SEEDS = 2**64          # sampling.seed is a uint64: seed + i wraps


def choice_heads(head: RequestHead, n: int, total: int) -> list[RequestHead]:
    """Choice g of `total` (n for each prompt of a batch): request ID-g (choice 0 is ID itself),
    its `choice` the index among its prompt's n (0 bills the prompt)."""
    return [head] + [replace(head, request_id=f"{head.request_id}-{g}", choice=g % n) for g in range(1, total)]


def choice_body(body: router_pb2.GenerateRequest, index: int,
                prompt: str | list[int] | None = None) -> router_pb2.GenerateRequest:
    """Choice `index`'s own copy of the request (the path may rewrite its model field), with
    `prompt` (a batch's) in place of the body's own when given."""
    copy = router_pb2.GenerateRequest()
    copy.CopyFrom(body)
    if prompt is not None:
        copy.ClearField("prompt")
        copy.ClearField("prompt_token_ids")
        set_prompt(copy, prompt)
    if index and body.sampling.HasField("seed"):
        copy.sampling.seed = (body.sampling.seed + index) % SEEDS
    return copy


async def one_choice(stream: AsyncIterator[common_pb2.GenerateChunk]):
    """n = 1: the stream as it is, in this task (no merging), tagged with index 0."""
    try:
        async for chunk in stream:
            yield 0, chunk
    finally:
        await stream.aclose()       # closed with this one, not when collected: it settles the request


async def merged(streams: list[AsyncIterator[common_pb2.GenerateChunk]], heads: list[RequestHead]):
    """(index, chunk) from every choice's stream, as they come, until each has sent its last chunk.
    Each stream runs in a task of its own (so it is admitted, and cancellable by its id, there)."""
    queue: asyncio.Queue = asyncio.Queue()       # unbounded: a choice never waits for another
    closing = False

    async def pump(index: int, stream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk, None))
            queue.put_nowait((index, None, None))
        except Exception as error:      # a ServiceError, or a bug: raised to the consumer as n = 1 would
            queue.put_nowait((index, None, error))
        except asyncio.CancelledError:
            if not closing:        # the Cancel API named this choice: the request ends
                queue.put_nowait((index, None, ServiceError(
                    ErrorKind.CANCELLED, f"request {heads[index].request_id} was cancelled", reason="cancelled")))
            raise

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    started: set[int] = set()
    held: list[tuple[int, common_pb2.GenerateChunk]] = []    # until every choice has started
    open_choices = set(range(len(streams)))
    try:
        while open_choices:
            index, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                if index in open_choices:
                    raise unavailable(f"choice {index} of request {heads[0].request_id} ended without its "
                                      "last chunk", reason="truncated")
                continue
            if chunk.finish_reason:
                open_choices.discard(index)
            if len(started) < len(streams):
                started.add(index)
                held.append((index, chunk))
                if len(started) < len(streams):
                    continue
                for item in held:
                    yield item
                held.clear()
                continue
            yield index, chunk
    finally:
        closing = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
