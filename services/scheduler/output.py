"""From sampled tokens to what a client stream carries: detokenize, stop strings, chunks, the last
chunk's usage and timings, and merging chunks that queued up behind a slow stream.

Pure Python: the batcher records every sampled token on its request before planning the next step,
then calls `token_chunk` for it and puts the chunk on the request's event queue (in its loop, once
the next step's plans are sent), or holds it in `HeldChunks` while the stream sends several tokens
a chunk (its stream interval); the Submit handler sends `coalesce`d events.
"""
from __future__ import annotations

import asyncio

from services.common.errors import ServiceError, invalid
from services.common.proto.qos.v1 import common_pb2
from services.common.step import FinishReason, guides_set
from services.scheduler import logprobs
from services.scheduler.request import Request


def timings(request: Request, now: float | None = None) -> common_pb2.Timings:
    return common_pb2.Timings(queue_ms=request.ms_since_arrival(request.first_scheduled_at),
                              ttft_ms=request.ms_since_arrival(request.first_token_at),
                              e2e_ms=request.ms_since_arrival(now))


def usage(request: Request) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=len(request.prompt_ids), completion_tokens=len(request.output_ids),
                            cached_tokens=request.cached_tokens, streaming=streaming_usage(request))


def streaming_usage(request: Request) -> common_pb2.StreamingUsage | None:
    """Set when streaming mode serves the request (clients must know the model did not attend the
    whole text at once)."""
    window = request.window
    return None if window is None else common_pb2.StreamingUsage(
        sink_tokens=window.sink_tokens, window_tokens=window.window_tokens)


def grammar_dead_end(request: Request) -> ServiceError:
    """The failure of a request whose structured output's grammar allowed no next token (the
    engine's FinishReason.ERROR): llguidance compiled it but cannot follow it. What was streamed
    stays; the request ends in this error, never in a "stop" with an incomplete answer."""
    name = guides_set(request.sampling)[0]
    what = "JSON schema" if name == "json_schema" else name
    return invalid(f"the request's {what} allows no next token after {len(request.output_ids)} generated "
                   "(a recursion that never ends, or a pattern too large to match): no complete answer "
                   f"follows it; simplify the {what}", field=f"sampling.{name}")


def token_chunk(request: Request, token_id: int, engine_finish: FinishReason | None, pool: str,
                now: float) -> common_pb2.GenerateChunk:
    """The chunk of a sampled token the request has recorded already (`add_output`, the last of
    its output so far). It ends the request (finish_reason set, with usage and timings) when the
    engine finished the sequence or a stop string matched."""
    detok = request.detokenizer
    text = detok.add(token_id)
    request.chunked += 1
    reason = FinishReason.STOP if detok.stopped else engine_finish
    chunk = common_pb2.GenerateChunk(request_id=request.request_id, text=text,
                                     token_ids=[token_id], pool=pool)
    if request.logprobs:
        chunk.logprobs.append(logprobs.entry(request, token_id))
    if request.prompt_logprobs is not None:
        chunk.prompt_logprobs.extend(logprobs.prompt_entries(request))
    if request.return_prompt_ids and request.chunked == 1:
        chunk.prompt_token_ids.extend(request.prompt_ids)
    if reason is None:
        if request.chunked == 1:
            # The first chunk tells the prompt's size (the router bills a request that ends early)
            # and the queueing and TTFT so far. Later chunks repeat neither: they would say the
            # same on every token (a message each, built and sent per token) until the last.
            chunk.usage.prompt_tokens = len(request.prompt_ids)
            chunk.usage.cached_tokens = request.cached_tokens
            if request.window is not None:
                chunk.usage.streaming.CopyFrom(streaming_usage(request))
            chunk.timings.CopyFrom(timings(request))
        return chunk
    if not detok.stopped:
        chunk.text += detok.flush()       # text held back in case a stop string was starting
    else:
        chunk.stop_string = detok.stop_string
    chunk.finish_reason = reason
    chunk.usage.CopyFrom(usage(request))
    chunk.timings.CopyFrom(timings(request, now))
    return chunk


def coalesce(event, queue: asyncio.Queue):
    """Merge chunks already waiting behind `event` into it: when this stream falls behind (a busy
    machine), one message carries several tokens instead of one message per token. Returns the
    event to send and a failure taken off the queue meanwhile (to send next), or None. A final
    chunk ends the merge."""
    if isinstance(event, ServiceError) or event.finish_reason or queue.empty():
        return event, None
    merged = common_pb2.GenerateChunk()
    merged.CopyFrom(event)
    while not queue.empty() and not merged.finish_reason:
        following = queue.get_nowait()
        if isinstance(following, ServiceError):
            return merged, following
        merge(merged, following)
    return merged, None


def merge(chunk: common_pb2.GenerateChunk, following: common_pb2.GenerateChunk) -> None:
    """`following`'s tokens and text appended to `chunk`; its end (reason, usage, timings) if it
    is the last."""
    chunk.text += following.text
    chunk.token_ids.extend(following.token_ids)
    chunk.logprobs.extend(following.logprobs)
    if following.finish_reason:
        chunk.finish_reason = following.finish_reason
        chunk.stop_string = following.stop_string
        chunk.usage.CopyFrom(following.usage)
        chunk.timings.CopyFrom(following.timings)


class HeldChunks:
    """Chunks held back from streams that send several tokens a chunk (a request's
    `stream_interval`): a batch job's client reads its tokens in tens, and every chunk it is not
    sent is a message fewer for the scheduler, the router and the client to handle, CPU the
    running steps and the real-time class's requests get instead. The first token's chunk always
    goes at once (it carries the time to first token) and so does the last; a chunk is never held
    longer than `max_hold_s` (`due`), so a stream that is slow or preempted still shows progress."""

    def __init__(self, max_hold_s: float):
        self.max_hold_s = max_hold_s
        self._held: dict[Request, tuple[common_pb2.GenerateChunk, float]] = {}   # chunk, held since
        self._next_check = 0.0

    def __len__(self) -> int:
        return len(self._held)

    def add(self, request: Request, chunk: common_pb2.GenerateChunk,
            now: float) -> common_pb2.GenerateChunk | None:
        """The chunk to send now (the held one with `chunk` merged in, or `chunk`), or None while
        it is held: fewer tokens than the request's interval, not the first nor the last."""
        held = self._held.pop(request, None)
        since = now
        if held is not None:
            merge(held[0], chunk)
            chunk, since = held
        if (chunk.finish_reason or chunk.HasField("timings") or len(chunk.token_ids) >= request.stream_interval
                or now - since >= self.max_hold_s):
            return chunk
        self._held[request] = (chunk, since)
        return None

    def take(self, request: Request) -> common_pb2.GenerateChunk | None:
        """The request's held chunk, no longer held (its stream fails or is cancelled)."""
        held = self._held.pop(request, None)
        return held[0] if held is not None else None

    def due(self, now: float) -> list[tuple[Request, common_pb2.GenerateChunk]]:
        """Chunks held `max_hold_s` or longer, no longer held: the streams whose request got no
        token since (waiting after a preemption, or a slow step). Looks at most four times per
        `max_hold_s`, so a loop may call it every step."""
        if not self._held or now < self._next_check:
            return []
        self._next_check = now + self.max_hold_s / 4
        due = [(request, chunk) for request, (chunk, since) in self._held.items() if now - since >= self.max_hold_s]
        for request, _ in due:
            del self._held[request]
        return due
