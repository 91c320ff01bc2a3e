"""From sampled tokens to what a client stream carries: detokenize, stop strings, chunks, the last
chunk's usage and timings, and merging chunks that queued up behind a slow stream.

Pure Python: the batcher records every sampled token on its request before planning the next step,
then calls `token_chunk` for it and puts the chunk on the request's event queue (in its loop, once
the next step's plans are sent); the Submit handler sends `coalesce`d events.
"""
from __future__ import annotations

import asyncio

from services.common.errors import ServiceError
from services.common.proto.qos.v1 import common_pb2
from services.common.step import FinishReason
from services.scheduler.request import Request


def timings(request: Request, now: float | None = None) -> common_pb2.Timings:
    return common_pb2.Timings(queue_ms=request.ms_since_arrival(request.first_scheduled_at),
                              ttft_ms=request.ms_since_arrival(request.first_token_at),
                              e2e_ms=request.ms_since_arrival(now))


def usage(request: Request) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=len(request.prompt_ids),
                            completion_tokens=len(request.output_ids))


def token_chunk(request: Request, token_id: int, engine_finish: FinishReason | None, pool: str,
                now: float) -> common_pb2.GenerateChunk:
    """The chunk of a sampled token the request has recorded already (`add_output`, the last of
    its output so far). It ends the request (finish_reason set, with usage and timings) when the
    engine finished the sequence or a stop string matched."""
    detok = request.detokenizer
    text = detok.add(token_id)
    reason = FinishReason.STOP if detok.stopped else engine_finish
    chunk = common_pb2.GenerateChunk(request_id=request.request_id, text=text,
                                     token_ids=[token_id], pool=pool)
    if reason is None:
        if len(request.output_ids) == request.resumed + 1:
            # The first chunk tells the prompt's size (the router bills a request that ends early)
            # and the queueing and TTFT so far. Later chunks repeat neither: they would say the
            # same on every token (a message each, built and sent per token) until the last.
            chunk.usage.prompt_tokens = len(request.prompt_ids)
            chunk.timings.CopyFrom(timings(request))
        return chunk
    if not detok.stopped:
        chunk.text += detok.flush()       # text held back in case a stop string was starting
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
        merged.text += following.text
        merged.token_ids.extend(following.token_ids)
        if following.finish_reason:
            merged.finish_reason = following.finish_reason
            merged.usage.CopyFrom(following.usage)
            merged.timings.CopyFrom(following.timings)
    return merged, None
