"""SubmitLink, many requests over one stream: the scheduler's end (services/scheduler/
link_session.py) and the router's (services/router/scheduler_link.py), over a real gRPC server in
this process whose `serve` is a stand-in for the scheduler's (chunks on cue, errors, cancellation
seen). Each request must get exactly its own chunks and errors, as a Submit call would."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import ErrorKind, ServiceError
from services.common.grpc_errors import ServiceErrorInterceptor
from services.common.grpc_server import CHANNEL_OPTIONS, SERVER_OPTIONS
from services.common.proto.qos.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.router.scheduler_link import LinkUnsupported, SchedulerLink
from services.scheduler.link_session import LinkSession

LENGTH = common_pb2.FINISH_REASON_LENGTH


class StandIn(scheduler_pb2_grpc.SchedulerServicer):
    """A scheduler whose requests stream `sampling.max_tokens` chunks, one per `step()`. A prompt
    "refuse" is refused with EXHAUSTED (retry in 1,500 ms) before any chunk; "fail" fails after
    its first chunk; "crash" raises a bug. `link=False`: a scheduler without SubmitLink."""

    def __init__(self, link: bool = True):
        self.tick = asyncio.Condition()
        self.steps = 0
        self.ended: dict[str, str] = {}       # request id -> "completed" / "cancelled" / "failed"
        self.traceparents: dict[str, str] = {}
        self.link = link

    async def step(self, count: int = 1) -> None:
        for _ in range(count):
            async with self.tick:
                self.steps += 1
                self.tick.notify_all()
            await asyncio.sleep(0.02)

    async def serve(self, submit: scheduler_pb2.SubmitRequest, traceparent: str):
        self.traceparents[submit.request_id] = traceparent
        outcome = "cancelled"
        try:
            if submit.prompt == "refuse":
                outcome = "failed"
                raise ServiceError(ErrorKind.EXHAUSTED, "queue full", retry_after_ms=1500, reason="queue_full")
            if submit.prompt == "crash":
                outcome = "failed"
                raise RuntimeError("a bug")
            tokens = submit.sampling.max_tokens
            for i in range(tokens):
                async with self.tick:
                    seen = self.steps
                    await self.tick.wait_for(lambda: self.steps > seen)
                if submit.prompt == "fail" and i == 1:
                    outcome = "failed"
                    raise ServiceError(ErrorKind.UNAVAILABLE, "no worker left", retry_after_ms=1000,
                                       reason="no_worker")
                last = i == tokens - 1
                yield common_pb2.GenerateChunk(request_id=submit.request_id, token_ids=[i], text=f"t{i}",
                                               finish_reason=LENGTH if last else 0)
            outcome = "completed"
        finally:
            self.ended[submit.request_id] = outcome

    async def Submit(self, submit, context):
        async for chunk in self.serve(submit, ""):
            yield chunk

    async def SubmitLink(self, requests, context):
        if not self.link:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        async for reply in LinkSession(self.serve).replies(requests):
            yield reply


async def started(servicer: StandIn):
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[ServiceErrorInterceptor()])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    link = SchedulerLink(scheduler_pb2_grpc.SchedulerStub(channel), f"stand-in at port {port}")
    return server, channel, link


def submit(request_id: str, tokens: int = 3, prompt: str = "hello") -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id=request_id, prompt=prompt,
                                       sampling=common_pb2.SamplingParams(max_tokens=tokens))


async def collect(call) -> tuple[list[str], ServiceError | None]:
    texts = []
    try:
        async for chunk in call:
            texts.append(chunk.text)
    except ServiceError as error:
        return texts, error
    return texts, None


def test_each_request_on_the_link_gets_its_own_chunks_and_errors_as_a_call_would():
    async def scenario():
        servicer = StandIn()
        server, channel, link = await started(servicer)
        try:
            calls = {name: link.submit(submit(name, tokens=n, prompt=p), f"00-{i:032x}-{i:016x}-01")
                     for i, (name, n, p) in enumerate([("a", 3, "hello"), ("b", 5, "hello"), ("r", 3, "refuse"),
                                                       ("f", 4, "fail"), ("c", 2, "crash")], start=1)}
            results = asyncio.gather(*(collect(c) for c in calls.values()))
            await asyncio.sleep(0.2)
            await servicer.step(6)
            return dict(zip(calls, await asyncio.wait_for(results, 10))), servicer, link.requests
        finally:
            link.close()
            await channel.close()
            await server.stop(None)

    results, servicer, left = asyncio.run(scenario())
    assert results["a"] == (["t0", "t1", "t2"], None)
    assert results["b"] == (["t0", "t1", "t2", "t3", "t4"], None)
    texts, refused = results["r"]
    # exactly what error_from_rpc makes of Submit's status and trailers: kind, reason, retry-after
    assert texts == [] and refused.kind is ErrorKind.EXHAUSTED and refused.message == "queue full"
    assert refused.retry_after_ms == 1500 and refused.reason == "queue_full"
    texts, failed = results["f"]
    assert texts == ["t0"] and failed.kind is ErrorKind.UNAVAILABLE and failed.retry_after_ms == 1000
    texts, crashed = results["c"]
    assert texts == [] and crashed.kind is ErrorKind.INTERNAL
    assert servicer.ended == {"a": "completed", "b": "completed", "r": "failed", "f": "failed", "c": "failed"}
    assert servicer.traceparents["b"] == f"00-{2:032x}-{2:016x}-01"
    assert left == 0


def test_a_step_s_chunks_for_every_request_leave_in_one_message():
    async def scenario():
        servicer = StandIn()
        session = LinkSession(servicer.serve)
        incoming: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (message := await incoming.get()) is not None:
                yield message
        replies = session.replies(requests())
        incoming.put_nowait(scheduler_pb2.LinkRequest(submits=[
            scheduler_pb2.LinkSubmit(key=k, submit=submit(f"r{k}", tokens=2)) for k in range(1, 21)]))
        got = []

        async def read():
            async for reply in replies:
                got.append(sorted(e.key for e in reply.events))
        reader = asyncio.create_task(read())
        await asyncio.sleep(0.1)
        await servicer.step(2)
        incoming.put_nowait(None)              # the router closes its side: ends once all are done
        await asyncio.wait_for(reader, 5)
        return got

    got = asyncio.run(scenario())
    assert got == [list(range(1, 21))] * 2      # two steps, two messages of 20 chunks each


def test_a_cancel_ends_its_request_at_the_scheduler_and_no_other():
    async def scenario():
        servicer = StandIn()
        server, channel, link = await started(servicer)
        try:
            stays, goes = link.submit(submit("stays", tokens=3), ""), link.submit(submit("goes", tokens=3), "")
            kept = asyncio.create_task(collect(stays))
            await asyncio.sleep(0.1)
            await servicer.step()
            async for _ in goes:
                break                           # the consumer stops after one chunk...
            goes.cancel()                        # ... as the router's relay does in its finally
            for _ in range(20):
                if "goes" in servicer.ended:
                    break
                await asyncio.sleep(0.05)
            await servicer.step(2)
            return await asyncio.wait_for(kept, 5), servicer.ended
        finally:
            link.close()
            await channel.close()
            await server.stop(None)

    kept, ended = asyncio.run(scenario())
    assert ended["goes"] == "cancelled"
    assert kept == (["t0", "t1", "t2"], None) and ended["stays"] == "completed"


def test_a_submit_and_its_cancel_in_one_message_leave_nothing_running():
    async def scenario():
        servicer = StandIn()
        session = LinkSession(servicer.serve)

        async def requests():
            yield scheduler_pb2.LinkRequest(submits=[scheduler_pb2.LinkSubmit(key=7, submit=submit("x"))],
                                            cancels=[7])
        replies = [r async for r in session.replies(requests())]
        return replies, session.requests

    replies, left = asyncio.run(asyncio.wait_for(scenario(), 5))
    assert replies == [] and left == 0


def test_when_the_scheduler_goes_every_request_on_the_link_fails_unavailable_and_the_next_opens_a_new_stream():
    async def scenario():
        servicer = StandIn()
        server, channel, link = await started(servicer)
        try:
            calls = [link.submit(submit(f"r{i}", tokens=5), "") for i in range(3)]
            results = asyncio.gather(*(collect(c) for c in calls))
            await asyncio.sleep(0.1)
            await servicer.step()
            await server.stop(None)             # the scheduler dies mid-stream
            outcomes = await asyncio.wait_for(results, 10)
            again = await asyncio.wait_for(collect(link.submit(submit("later"), "")), 10)
            return outcomes, again
        finally:
            link.close()
            await channel.close()

    outcomes, again = asyncio.run(scenario())
    for texts, error in outcomes:
        assert texts == ["t0"]
        assert error.kind is ErrorKind.UNAVAILABLE and "stand-in at port" in error.message
    texts, error = again                         # a new stream, to a scheduler that is gone
    assert texts == [] and error.kind is ErrorKind.UNAVAILABLE


def test_a_scheduler_without_submit_link_is_reported_once_and_the_link_refuses_from_then_on():
    async def scenario():
        servicer = StandIn(link=False)
        server, channel, link = await started(servicer)
        try:
            tries = 0
            while not link.unsupported and tries < 5:      # a try whose status gRPC lost tries again
                tries += 1
                with pytest.raises(LinkUnsupported):
                    async for _ in link.submit(submit(f"a{tries}"), ""):
                        pass
            with pytest.raises(LinkUnsupported):
                link.submit(submit("b"), "")
            return link.unsupported
        finally:
            link.close()
            await channel.close()
            await server.stop(None)

    assert asyncio.run(scenario()) is True


class LostStatusStub:
    """A SubmitLink whose stream takes `taken` messages, sends `replies` empty replies, then fails
    as gRPC's asyncio client reports a write that failed after the server's status arrived."""

    def __init__(self, taken: int, replies: int = 0, details: str = "Internal error from Core"):
        self.taken, self.replies, self.details = taken, replies, details

    def SubmitLink(self, requests, metadata=()):
        stub = self

        class Call:
            def cancel(self):
                return True

            async def __aiter__(self):
                async for _ in requests:
                    stub.taken -= 1
                    if stub.taken == 0:
                        break
                for _ in range(stub.replies):
                    yield scheduler_pb2.LinkReply()
                raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           stub.details)
        return Call()


@pytest.mark.parametrize("taken, replies, details, falls_back", [
    (1, 0, "Internal error from Core", True),       # the one message written failed: nothing was sent
    (2, 0, "Internal error from Core", False),      # the first may have reached the scheduler
    (1, 1, "Internal error from Core", False),      # the scheduler answered: it has the link
    (1, 0, "Exception calling application", False),  # a real INTERNAL from the scheduler
])
def test_a_status_grpc_lost_falls_back_to_calls_only_when_nothing_was_sent(taken, replies, details, falls_back):
    async def scenario():
        link = SchedulerLink(LostStatusStub(taken, replies, details), "stand-in")
        calls = [link.submit(submit("a"), "")]
        await asyncio.sleep(0)
        if taken > 1:
            calls.append(link.submit(submit("b"), ""))
        errors = []
        for call in calls:
            try:
                async for _ in call:
                    pass
            except (LinkUnsupported, ServiceError) as error:
                errors.append(error)
        return errors, link.unsupported

    errors, unsupported = asyncio.run(scenario())
    assert all(isinstance(e, LinkUnsupported) for e in errors) is falls_back and errors
    assert not unsupported          # the next request tries the link again


class Tally:
    """What the relay reports to the router's tally: chunks seen, done, or cancelled."""

    def __init__(self):
        self.chunks, self.done, self.cancelled = 0, False, False

    def on_chunk(self, chunk):
        self.chunks += 1

    def on_done(self, chunk):
        self.done = True

    def on_cancel(self):
        self.cancelled = True


def relay_path(link_mode: str, port_link: SchedulerLink, channel):
    """The router's real RequestPath.relay, with stand-ins for the pool directory and accounts."""
    from types import SimpleNamespace

    from opentelemetry import trace

    from services.common.priority import Priority
    from services.router.request_path import RequestPath
    from services.router.validation import RequestHead
    pools = SimpleNamespace(specs={"p": None})
    accounts = SimpleNamespace(amount=lambda spec, priority, tokens, cached=0: 0.5)
    path = RequestPath(pools, None, trace.get_tracer("test"), "m", accounts, scheduler_link=link_mode)
    pool = SimpleNamespace(name="p", peer="stand-in", link=port_link, metadata=(),
                           scheduler=scheduler_pb2_grpc.SchedulerStub(channel))
    return path, pool, RequestHead(Priority.MEDIUM, request_id="q")


def body(tokens: int):
    from services.common.proto.qos.v1 import router_pb2
    return router_pb2.GenerateRequest(prompt="hello", sampling=common_pb2.SamplingParams(max_tokens=tokens))


@pytest.mark.parametrize("has_link, mode", [(False, "stream"), (True, "stream"), (True, "calls")])
def test_the_router_s_relay_streams_the_same_answer_on_the_link_on_calls_and_from_a_scheduler_without_a_link(
        has_link, mode):
    async def scenario():
        servicer = StandIn(link=has_link)
        server, channel, link = await started(servicer)
        try:
            path, pool, head = relay_path(mode, link, channel)
            tally = Tally()
            relay = path.relay(head, body(3), pool, tally, trace_span())
            got = asyncio.create_task(collect_chunks(relay))
            await asyncio.sleep(0.2)
            await servicer.step(3)
            return await asyncio.wait_for(got, 10), tally, link.unsupported
        finally:
            link.close()
            await channel.close()
            await server.stop(None)

    chunks, tally, unsupported = asyncio.run(scenario())
    assert [c.text for c in chunks] == ["t0", "t1", "t2"]
    assert chunks[-1].cost_units == 0.5 and tally.done and tally.chunks == 3 and not tally.cancelled
    assert unsupported is (mode == "stream" and not has_link)


def test_a_client_that_goes_away_cancels_its_request_at_the_scheduler_through_the_link():
    async def scenario():
        servicer = StandIn()
        server, channel, link = await started(servicer)
        try:
            path, pool, head = relay_path("stream", link, channel)
            tally = Tally()
            relay = path.relay(head, body(5), pool, tally, trace_span())
            first = asyncio.create_task(anext(relay))
            await asyncio.sleep(0.2)
            await servicer.step()
            first = await asyncio.wait_for(first, 5)
            await relay.aclose()               # the client went away after the first chunk
            for _ in range(40):
                if "q" in servicer.ended:
                    break
                await asyncio.sleep(0.05)
            return first, tally, servicer.ended.get("q"), link.requests
        finally:
            link.close()
            await channel.close()
            await server.stop(None)

    first, tally, ended, left = asyncio.run(scenario())
    assert first.text == "t0" and tally.cancelled and not tally.done
    assert ended == "cancelled" and left == 0


def trace_span():
    from opentelemetry import trace
    return trace.INVALID_SPAN


async def collect_chunks(relay):
    return [chunk async for chunk in relay]
