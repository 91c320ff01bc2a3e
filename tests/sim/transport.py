"""gRPC as the real WorkerLink sees it, without sockets: a ClusterTrust whose channel() gives a
channel whose calls reach the simulated worker at that address (services/scheduler/worker_link.py
builds a WorkerStub on it and cannot tell). Calls to an address with no live process fail as
UNAVAILABLE; unary calls honour their timeout (DEADLINE_EXCEEDED) as gRPC does.
"""
from __future__ import annotations

import asyncio

import grpc

from services.common.proto.qos.v1 import worker_pb2
from tests.sim.worker import END, Session, rpc_error

LATENCY_S = 0.0002


class ExecuteCall:
    """The scheduler's end of one Execute stream: answers as an async iterator; cancel()."""

    def __init__(self, network: Network, address: str, plans):
        self._results: asyncio.Queue = asyncio.Queue()
        self.session: Session | None = None
        self.cancelled = False
        self.network = network
        self._opening = asyncio.ensure_future(network.open_execute(address, self, plans))

    def __aiter__(self):
        return self

    async def __anext__(self) -> worker_pb2.StepResult:
        item = await self._results.get()
        if item is END or isinstance(item, BaseException):
            self._results.put_nowait(item)      # every later read ends the same way
            if item is END:
                raise StopAsyncIteration
            raise item
        return item

    def deliver(self, item) -> None:
        self.network.sim.events += 1
        if not self.cancelled:
            self._results.put_nowait(item)

    def cancel(self) -> None:
        """The scheduler cancels the call: its reads end, and the worker sees the stream close
        (a stopped worker once it runs again)."""
        if self.cancelled:
            return
        self._results.put_nowait(asyncio.CancelledError())
        self.cancelled = True
        self._opening.cancel()
        session = self.session
        if session is not None:
            async def close_on_worker():
                await session.worker.awake()
                session.end(END)
            asyncio.ensure_future(close_on_worker())


class Network:
    """Addresses -> simulated worker processes."""

    def __init__(self, sim):
        self.sim = sim
        self.workers: dict[str, object] = {}

    def live(self, address: str):
        worker = self.workers.get(address)
        return worker if worker is not None and worker.alive else None

    async def unary(self, address: str, method: str, request, timeout: float | None):
        try:
            return await asyncio.wait_for(self._unary(address, method, request), timeout)
        except asyncio.TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None

    async def _unary(self, address: str, method: str, request):
        await asyncio.sleep(LATENCY_S)
        worker = self.live(address)
        sim = self.sim
        if worker is None:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
        await worker.awake()
        if worker is not self.live(address):
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        if method == "Info":
            if sim.faults.now("info_fail", sim.loop.now, f"{address} Info"):
                if sim.rng.random() < 0.5:
                    await asyncio.sleep(10.0)       # past the caller's timeout
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            return worker.info()
        if method == "LoadAdapter":
            return worker.load_adapter(request)
        if method == "UnloadAdapter":
            return worker.unload_adapter(request)
        raise rpc_error(grpc.StatusCode.UNIMPLEMENTED, method)

    async def open_execute(self, address: str, call: ExecuteCall, plans) -> None:
        await asyncio.sleep(LATENCY_S)
        worker = self.live(address)
        sim = self.sim
        if worker is None:
            call.deliver(rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"))
            return
        await worker.awake()
        if worker.draining:
            call.deliver(rpc_error(grpc.StatusCode.UNAVAILABLE, "worker drains"))
            return
        if worker.session is not None:
            call.deliver(rpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                                   "this worker already serves a scheduler (one Execute stream at a time)"))
            return
        if sim.faults.now("hello_lost", sim.loop.now, f"{address} hello"):
            return          # the stream opens and nothing ever comes (the link's 5 s wait)
        session = worker.session = call.session = Session(worker, call, plans)
        if sim.faults.now("break_after_hello", sim.loop.now, f"{address} reconnect"):
            sim.loop.call_later(sim.rng.uniform(0.0, 0.01), session._break, f"{address} reconnect")


class _Unary:
    def __init__(self, network: Network, address: str, method: str):
        self.network, self.address, self.method = network, address, method

    def __call__(self, request, timeout=None, metadata=None):
        return self.network.unary(self.address, self.method, request, timeout)


class _Stream:
    def __init__(self, network: Network, address: str):
        self.network, self.address = network, address

    def __call__(self, plans, metadata=None):
        return ExecuteCall(self.network, self.address, plans)


class FakeChannel:
    def __init__(self, network: Network, address: str):
        self.network, self.address = network, address

    def unary_unary(self, path: str, request_serializer=None, response_deserializer=None, **_):
        return _Unary(self.network, self.address, path.rsplit("/", 1)[-1])

    def stream_stream(self, path: str, request_serializer=None, response_deserializer=None, **_):
        return _Stream(self.network, self.address)

    def unary_stream(self, path: str, *args, **kwargs):
        return _Unary(self.network, self.address, path.rsplit("/", 1)[-1])

    stream_unary = unary_stream

    async def close(self) -> None:
        pass


class FakeTrust:
    """What WorkerLink asks of a ClusterTrust: a channel and call metadata."""
    metadata = ()

    def __init__(self, network: Network):
        self.network = network

    def channel(self, address: str, role: str, options=()) -> FakeChannel:
        return FakeChannel(self.network, address)
