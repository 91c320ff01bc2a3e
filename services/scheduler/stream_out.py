"""The clients' side of a step: each sampled token made into text and a chunk on its request's
stream, and failures after them, in order.

In the batcher's run(), the tokens of the step's last worker to answer reach their streams only
once the next step's plans are sent (`hold` ... `release`): every client stream's handler then
wakes up, and each costs the event loop a message (~0.1-0.2 ms); run first, they held the next plan
back while the workers waited idle. Before the plans, postprocess only records each token (what
planning needs); its text (detokenizing, stop strings) and chunk are made here, after (~15 us a
token). Streams with a stream interval get their chunks held until they have that many tokens
(output.HeldChunks).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from services.common.proto.qos.v1 import worker_pb2
from services.common.step import FinishReason
from services.common.wire import sampled_and_ended
from services.scheduler import logprobs
from services.scheduler.output import HeldChunks, token_chunk
from services.scheduler.request import Phase, Request


class SampledText(NamedTuple):
    """A token postprocess recorded, whose text and chunk are still to be made (StreamOut.deliver)."""
    token_id: int
    engine_finish: FinishReason | None     # the engine ended the sequence with it
    at: float                              # when its step's answer came (perf_counter)


class StreamOut:
    def __init__(self, pool_name: str, stream_max_hold_s: float, stopped: Callable[[Request, float], None]):
        self.pool_name = pool_name
        self.held_chunks = HeldChunks(stream_max_hold_s)   # chunks of streams with an interval > 1
        self._stopped = stopped          # a stop string ended the request (the batcher finishes it)
        self._held: list[tuple[Request, object]] | None = None     # None while nothing is held

    @property
    def holding(self) -> bool:
        return self._held is not None

    def hold(self) -> None:
        """Hold what is emitted from now on until release()."""
        if self._held is None:
            self._held = []

    def emit(self, request: Request, event) -> None:
        """A sampled token (its chunk to build) or a failure for the request's stream: now, or at
        release() while holding; in order either way."""
        if self._held is not None:
            self._held.append((request, event))
        else:
            self.deliver(request, event)

    def deliver(self, request: Request, event) -> None:
        if isinstance(event, SampledText):
            self._stream(request, event)
            return
        if self.held_chunks:            # a failure: the tokens held for the stream go first
            held = self.held_chunks.take(request)
            if held is not None:
                request.events.put_nowait(held)
        request.events.put_nowait(event)

    def release(self) -> None:
        """What was held, into the streams, in order: each token's text and chunk, failures; then
        the chunks of slow streams held for their interval as long as they may be."""
        held, self._held = self._held, None
        for request, event in held or ():
            self.deliver(request, event)
        for request, chunk in self.held_chunks.due(time.perf_counter()):
            request.events.put_nowait(chunk)

    @staticmethod
    def answer_tokens(result: worker_pb2.StepResult, scheduled: list[Request]):
        """A step's answer as postprocess reads it: its (seq_id, token_id) pairs and the finish
        reasons of the sequences they end (wire.sampled_and_ended); its logprobs are kept on
        their requests for their tokens' chunks (logprobs.py)."""
        if result.logprob_seq_ids:
            logprobs.record(result, {r.seq_id: r for r in scheduled})
        if result.prompt_logprobs:
            logprobs.record_prompt(result, scheduled)
        return sampled_and_ended(result)

    def forget(self, request: Request) -> None:
        """The client went away: nobody reads its held chunks now."""
        self.held_chunks.take(request)

    def _stream(self, request: Request, token: SampledText) -> None:
        """A token recorded by postprocess, into its stream: text (detokenized), stop strings,
        the chunk. A stop string ends the request here; in run() the plan sent meanwhile may
        have scheduled one more token of it, which the worker drops at the next step (released
        like a cancelled sequence) and postprocess ignores."""
        if request.cancelled:
            return
        chunk = token_chunk(request, token.token_id, token.engine_finish, self.pool_name, token.at)
        stopped = chunk.finish_reason and token.engine_finish is None
        if request.stream_interval > 1:
            chunk = self.held_chunks.add(request, chunk, token.at)
        if chunk is not None:
            request.events.put_nowait(chunk)
        if stopped and request.phase is not Phase.FINISHED:
            self._stopped(request, token.at)
