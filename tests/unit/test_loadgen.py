"""The QoS benchmark's client processes (bench/loadgen.py): a client that dies says so; waiting
for some classes only returns their outcomes and stops the other clients."""
from __future__ import annotations

import asyncio
import multiprocessing
import sys

import grpc
import pytest

from bench.loadgen import Front, Job, _receive, run_clients
from services.common.priority import PRIORITY_HEADER
from services.common.proto.qos.v1 import common_pb2, router_pb2_grpc


def test_a_client_that_dies_without_reporting_is_named_with_its_exit_code():
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=sys.exit, args=(3,), name="client-low")
    process.start()
    theirs.close()            # the child's end is now held by the child alone
    process.join(timeout=60)
    with pytest.raises(RuntimeError, match="client-low exited with 3 without reporting"):
        _receive(process, ours)


class HoldsLow(router_pb2_grpc.RouterServicer):
    """A stand-in router: answers High at once, never finishes Low (counts the Low calls that
    ended, as a client's going away ends them)."""

    def __init__(self):
        self.low_ended = 0

    async def Generate(self, request, context):
        priority = dict(context.invocation_metadata()).get(PRIORITY_HEADER)
        if priority == "high":
            yield common_pb2.GenerateChunk(token_ids=[1], text="a", finish_reason=common_pb2.FINISH_REASON_LENGTH)
            return
        try:
            yield common_pb2.GenerateChunk(token_ids=[1], text="a")
            await asyncio.sleep(3600)
        finally:
            self.low_ended += 1


def test_until_done_returns_with_the_chosen_clients_outcomes_and_stops_the_others():
    async def scenario():
        servicer = HoldsLow()
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            jobs = [Job("high", "hi", 1, 1, at=0.0), Job("high", "hi", 1, 1, at=0.05)] + \
                   [Job("low", "batch", 1, 8, at=0.0) for _ in range(3)]
            outcomes, _ = await asyncio.wait_for(
                run_clients(Front("grpc", f"127.0.0.1:{port}"), jobs, until_done={"high"}), timeout=120)
            for _ in range(100):            # the killed client's streams end at the server
                if servicer.low_ended == 3:
                    break
                await asyncio.sleep(0.05)
            return outcomes, servicer.low_ended
        finally:
            await server.stop(None)

    outcomes, low_ended = asyncio.run(scenario())
    assert [o.priority for o in outcomes] == ["high", "high"] and all(o.ok for o in outcomes)
    assert low_ended == 3
