"""Simulated clients: each submits one request the way the scheduler's Submit handler does
(services/scheduler/server.py: drain check, adapter check, admission, then the batcher), reads its
stream, and may go away at any moment (the handler's `finally` cancels it in the batcher).

Every event the scheduler puts on a stream is checked at that moment (Client.on_event): it must
continue the fault-free output exactly, and come neither after the stream's end nor after the
client went away.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.common.errors import ErrorKind, ServiceError
from services.common.proto.qos.v1 import common_pb2
from services.scheduler.admission import pool_limits
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.long_context import choose_window
from services.scheduler.request import Request
from tests.sim.invariants import ACTIONABLE
from tests.sim.model import LetterDecoder, expected_tokens

DECODER = LetterDecoder()


@dataclass
class ClientSpec:
    seq_id: int
    arrival: float
    priority: int
    tenant: str
    prompt: list[int]
    max_tokens: int
    seed: int | None
    ignore_eos: bool
    stop: list[str]
    lora: str
    streaming: bool
    stream_interval: int
    cancel_after: float | None      # seconds after submitting; None: never


class CheckedQueue(asyncio.Queue):
    """A request's event queue that shows every event to its client as it is put."""

    def __init__(self, client: Client):
        super().__init__()
        self.client = client

    def put_nowait(self, item) -> None:
        self.client.on_event(item)
        super().put_nowait(item)


class Client:
    def __init__(self, sim, spec: ClientSpec):
        self.sim, self.spec = sim, spec
        self.name = f"r{spec.seq_id}"
        self.request: Request | None = None
        self.tokens: list[int] = []
        self.text = ""
        self.ended: object = None            # the final chunk or the error
        self.gone = False                    # went away (cancelled its call)
        self.refused: ServiceError | None = None
        self.done = False
        tokens = expected_tokens(spec.prompt, spec.seed, spec.max_tokens, spec.ignore_eos)
        text = DECODER.decode(tokens)
        stops = [text.find(s) for s in spec.stop if s and text.find(s) >= 0]
        self.stopped_by_string = bool(stops)
        self.expected_tokens = tokens
        self.expected_text = text[:min(stops)] if stops else text

    def describe(self) -> str:
        r = self.request
        state = "not submitted" if r is None else f"{r.phase.value} on worker {r.worker}"
        return f"{state}, {len(self.tokens)}/{len(self.expected_tokens)} tokens"

    # --- what the scheduler puts on the stream --------------------------------------------------

    def on_event(self, event) -> None:
        self.sim.events += 1
        fail = self.sim.invariants.fail
        if self.ended is not None:
            fail(f"{self.name}: an event after its stream ended ({_what(self.ended)}): {_what(event)}")
        if self.gone:
            fail(f"{self.name}: an event after the client went away: {_what(event)}")
        if isinstance(event, ServiceError):
            allowed = ACTIONABLE.get(event.kind, ())
            if allowed is not None and event.reason not in allowed:
                fail(f"{self.name} failed with an error a client cannot act on: {event.kind.value} "
                     f"({event.reason}): {event.message}")
            self.ended = event
            return
        start = len(self.tokens)
        self.tokens.extend(event.token_ids)
        self.text += event.text
        if self.tokens != self.expected_tokens[:len(self.tokens)]:
            fail(f"{self.name}: tokens {start}.. are {list(event.token_ids)}, the fault-free run has "
                 f"{self.expected_tokens[start:start + len(event.token_ids)]}")
        if not self.expected_text.startswith(self.text):
            fail(f"{self.name}: text {self.text!r} is not a prefix of the fault-free {self.expected_text!r}")
        if event.finish_reason:
            self.ended = event
            complete = self.text == self.expected_text and (
                self.stopped_by_string or self.tokens == self.expected_tokens)
            if not complete:
                fail(f"{self.name} completed ({common_pb2.FinishReason.Name(event.finish_reason)}) with "
                     f"{len(self.tokens)} of {len(self.expected_tokens)} tokens, {self.text!r}")

    # --- the client's life ------------------------------------------------------------------------

    async def run(self) -> None:
        spec, sim = self.spec, self.sim
        await asyncio.sleep(spec.arrival)
        try:
            request = self.submit()
        except ServiceError as refused:
            self.refused = refused
            self.on_event(refused)
            self.done = True
            return
        self.request = request
        sim.events += 1
        sim.batcher.submit(request)
        if spec.cancel_after is not None:
            sim.loop.call_later(spec.cancel_after, self.go_away)
        try:
            while not self.done:
                event = await request.events.get()
                if isinstance(event, ServiceError) or event.finish_reason:
                    self.done = True
        finally:
            sim.batcher.cancel(request)       # as the Submit handler's finally does, always

    def go_away(self) -> None:
        """The client cancels its call: the handler's finally runs (batcher.cancel)."""
        if self.done or self.request is None:
            return
        self.gone = self.done = True
        self.sim.events += 1
        self.sim.batcher.cancel(self.request)
        self.sim.faults.log.append((round(self.sim.loop.now, 6), "cancel", self.name))
        self.task.cancel()

    def submit(self) -> Request:
        """What SchedulerService.admit and serve do before the batcher (no tokenizer: ids given)."""
        spec, sim = self.spec, self.sim
        sim.drain.check()
        limits = pool_limits((l.info for l in sim.batcher.links if l.is_connected), sim.pool_name)
        if spec.lora and spec.lora not in sim.pool_adapters.held():
            raise ServiceError(ErrorKind.UNSUPPORTED, f"LoRA adapter {spec.lora!r} is not loaded",
                               field="x-lora", reason="unknown_adapter")
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=spec.max_tokens,
                                             ignore_eos=spec.ignore_eos, stop=spec.stop)
        if spec.seed is not None:
            sampling.seed = spec.seed
        mode = common_pb2.CONTEXT_MODE_STREAMING if spec.streaming else common_pb2.CONTEXT_MODE_DENSE
        window = choose_window(mode, spec.priority, len(spec.prompt), sampling, limits.max_context,
                               limits.block_size, sim.streaming)
        resolved = sim.admission.check(spec.priority, spec.prompt, sampling, 0, limits, window)
        return Request(
            request_id=self.name, seq_id=spec.seq_id, priority=spec.priority, tenant=spec.tenant,
            prompt_ids=list(spec.prompt), sampling=resolved, lora=spec.lora, window=window,
            detokenizer=IncrementalDetokenizer(DECODER, spec.prompt, stop=list(spec.stop)),
            stream_interval=spec.stream_interval, events=CheckedQueue(self),
            arrival=sim.loop.now, arrival_ns=int(sim.loop.now * 1e9))


def _what(event) -> str:
    if isinstance(event, ServiceError):
        return f"error {event.kind.value}: {event.message}"
    return f"chunk {list(event.token_ids)}{' (final)' if event.finish_reason else ''}"
