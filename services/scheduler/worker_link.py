"""The scheduler's connection to one worker: Info, the Execute stream, reconnection.

The link owns the worker's KV block pool: block ids are only meaningful for the worker that
allocated its cache, and a worker that restarts has lost every block, so the pool is rebuilt from
its Info each time the link (re)connects. A link counts as connected only once the worker has
answered a first (empty) plan on the new stream, and never to a worker that drains.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from services.common.cluster_auth import ClusterTrust, no_trust
from services.common.grpc_server import WORKER_CHANNEL_OPTIONS
from services.common.proto.qos.v1 import worker_pb2, worker_pb2_grpc
from services.common.kv_blocks import KVBlockPool
from services.scheduler.worker_set import WorkerGone

log = logging.getLogger(__name__)

RECONNECT_INTERVAL_SECONDS = 0.5


class WorkerLink:
    def __init__(self, index: int, address: str, trust: ClusterTrust | None = None,
                 make_pool: Callable[..., KVBlockPool] = KVBlockPool):
        self.index = index
        self.make_pool = make_pool      # a fresh pool per connection: a reconnected worker's cache is unknown
        self.address = address
        self.trust = trust or no_trust("scheduler")   # token and certificates for every call
        self.info: worker_pb2.WorkerInfo | None = None
        self.adapters: frozenset[str] = frozenset()   # LoRA adapters it holds (from its info)
        self.pool: KVBlockPool | None = None
        self._channel: grpc.aio.Channel | None = None
        self._plans: asyncio.Queue | None = None
        self._results = None
        self._call = None
        self._answers: dict[int, asyncio.Future] = {}     # step_id -> its plan's answer, to come
        self._reader: asyncio.Task | None = None
        self.connected = asyncio.Event()
        self.held_off_until = 0.0        # monotonic: no reconnection before (hold_off)
        # Told (link, why) at once when a connected link goes down, wherever that happens: between
        # two steps no step fails to say so (the batcher: WorkerChanges.link_closed).
        self.on_closed: Callable[[WorkerLink, str], None] | None = None

    @property
    def is_connected(self) -> bool:
        return self.connected.is_set()

    async def connect(self) -> None:
        """Open the channel and the Execute stream and see it answer; raises WorkerGone."""
        await self.close()
        self._channel = self.trust.channel(self.address, "worker", WORKER_CHANNEL_OPTIONS)
        stub = worker_pb2_grpc.WorkerStub(self._channel)
        metadata = self.trust.metadata
        try:
            info = await stub.Info(worker_pb2.InfoRequest(), timeout=5.0, metadata=metadata)
            if info.draining:
                raise WorkerGone(f"worker {self.address} is draining")
            self._plans = asyncio.Queue()
            self._call = stub.Execute(self._plan_iterator(self._plans), metadata=metadata)
            self._results = self._call.__aiter__()
            # A refused stream (another scheduler holds it, or the worker began to drain) shows
            # here, before any request is placed on it.
            self._plans.put_nowait((worker_pb2.StepPlan(step_id=0), None))
            hello = await asyncio.wait_for(self._results.__anext__(), timeout=5.0)
            if hello.draining:
                raise WorkerGone(f"worker {self.address} is draining")
        except (grpc.aio.AioRpcError, StopAsyncIteration, asyncio.TimeoutError, WorkerGone) as exc:
            await self.close()
            if isinstance(exc, WorkerGone):
                raise
            detail = f"{exc.code().name} {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) \
                else type(exc).__name__
            raise WorkerGone(f"worker {self.address}: {detail}") from exc
        self.info = info
        self.adapters = frozenset(a.name for a in info.adapters)
        # With a second tier (and prefix caching), the pool mirrors it: services/scheduler/kv_tier.py.
        tier = (info.kv_tier_blocks, info.kv_tier_load_us_per_block) if info.kv_tier_blocks else ()
        self.pool = self.make_pool(info.num_blocks, info.block_size, *tier)
        self._reader = asyncio.create_task(self._read_answers(self._results))
        self.connected.set()
        log.info("connected to worker %s: %s on %s, %d KV blocks of %d tokens", self.address,
                 self.info.model, self.info.device, self.info.num_blocks, self.info.block_size)

    @property
    def max_loras(self) -> int:
        return self.info.max_loras if self.info and self.info.max_loras else 1 << 30

    async def load_adapter(self, name: str, path: str) -> worker_pb2.LoadAdapterReply:
        """Worker.LoadAdapter; from now on the worker may be given sequences naming it (and no
        longer those naming adapters it dropped to make room)."""
        reply = await worker_pb2_grpc.WorkerStub(self._channel).LoadAdapter(
            worker_pb2.LoadAdapterRequest(name=name, path=path), timeout=120, metadata=self.trust.metadata)
        self.adapters = (self.adapters | {name}) - set(reply.dropped)
        return reply

    async def unload_adapter(self, name: str) -> None:
        await worker_pb2_grpc.WorkerStub(self._channel).UnloadAdapter(
            worker_pb2.UnloadAdapterRequest(name=name), timeout=30, metadata=self.trust.metadata)
        self.adapters = self.adapters - {name}

    def hold_off(self, seconds: float) -> None:
        self.held_off_until = time.monotonic() + seconds

    async def keep_connected(self) -> None:
        """Reconnect whenever the link is down and not held off (run as a background task)."""
        while True:
            if not self.is_connected and time.monotonic() >= self.held_off_until:
                try:
                    await self.connect()
                except WorkerGone as exc:
                    log.debug("%s", exc)
            await asyncio.sleep(RECONNECT_INTERVAL_SECONDS)

    @staticmethod
    async def _plan_iterator(queue: asyncio.Queue):
        while True:
            item = await queue.get()
            if item is None:
                return
            plan, sent = item
            yield plan
            # gRPC asks for the next plan only once it has written this one.
            if sent is not None and not sent.done():
                sent.set_result(None)

    async def execute(self, plan: worker_pb2.StepPlan,
                      sent: asyncio.Future | None = None) -> worker_pb2.StepResult:
        """Send one plan and wait for its answer; raises WorkerGone when the stream breaks (the
        link is then marked down and every block it held is gone). `sent` is set once gRPC has
        written the plan (the scheduler's loop waits for that before it streams tokens). Plans may
        overlap (a cut-in while a step computes): answers are matched to plans by step_id."""
        if not self.is_connected:
            raise WorkerGone(f"worker {self.address} is not connected")
        tier = getattr(self.pool, "tier", None)
        if tier is not None and tier.blocks:      # copies recorded since the last plan: this one's
            blocks, slots, loads = tier.take_copies()
            plan.tier_block_ids.extend(blocks)
            plan.tier_slots.extend(slots)
            plan.tier_loads.extend(loads)
        answer = asyncio.get_running_loop().create_future()
        self._answers[plan.step_id] = answer
        self._plans.put_nowait((plan, sent))
        try:
            result = await answer
        finally:
            self._answers.pop(plan.step_id, None)
        if tier is not None:
            tier.note_step(sum(plan.scheduled_num_tokens), result.forward_ms)
        return result

    async def _read_answers(self, results) -> None:
        """Every answer to the plan it is for, until the stream ends or breaks: then the link is
        closed and every plan still unanswered fails with WorkerGone."""
        try:
            async for result in results:
                answer = self._answers.get(result.step_id)
                if answer is None:
                    failure = f"worker {self.address} answered step {result.step_id}, which it was not sent"
                    break
                if not answer.done():
                    answer.set_result(result)
            else:
                failure = f"worker {self.address} failed: stream ended"
        except asyncio.CancelledError:
            # close() cancelled the call (the worker left the pool mid-step, or we stop): for a
            # loop waiting on a step, that is a worker gone.
            failure = f"worker {self.address}: its stream was closed mid-step"
        except grpc.aio.AioRpcError as exc:
            failure = f"worker {self.address} failed: {exc.code().name} {exc.details()}"
        self._fail_answers(failure)
        if self._reader is asyncio.current_task():
            self._reader = None
            await self.close(failure)

    def _fail_answers(self, failure: str) -> None:
        answers, self._answers = self._answers, {}
        for answer in answers.values():
            if not answer.done():
                answer.set_exception(WorkerGone(failure))

    async def close(self, reason: str = "") -> None:
        """Down: every block of its pool is gone, plans unanswered fail, and (if it was up) the
        batcher is told before anything else runs, so that its sequences move at once."""
        was_connected = self.connected.is_set()
        self.connected.clear()
        self.pool = None
        if self._reader is not None:
            reader, self._reader = self._reader, None
            reader.cancel()
        self._fail_answers(f"worker {self.address}: its stream was closed mid-step")
        if was_connected and self.on_closed is not None:
            self.on_closed(self, reason or f"worker {self.address}: its stream was closed")
        if self._plans is not None:
            self._plans.put_nowait(None)
            self._plans = None
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
