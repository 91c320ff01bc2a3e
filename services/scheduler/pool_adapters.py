"""A pool's LoRA adapters at run time: Scheduler.LoadAdapter and UnloadAdapter, and the run-time
ones loaded onto workers that join later.

Loading a name that is already loaded (a reload: new weights under the same name) must never let
K/V computed under the old weights be read under the new ones, nor let a sequence go on under
weights it did not start with:
- It is refused (CONFLICT: FAILED_PRECONDITION / 409, naming the adapter) while a running or
  queued request of the pool names it: their K/V so far, and their output, came from the old
  weights. vLLM too refuses to load a name already loaded unless runtime updating is turned on;
  to switch at once, load the new weights under a new name.
- While the workers swap, no request naming it is admitted (Planner.held_adapters): placed now,
  it would compute under the old weights on a worker that has not swapped yet.
- The adapter's load generation, part of its blocks' names (prefix_cache.py), moves on only once
  every worker has answered, so no block computed under the old weights is found again.
- A worker that could not load the new weights still holds the old ones under the name: it is
  asked to drop them and given no request naming it until it loads them (sync()).
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.errors import ErrorKind, ServiceError
from services.common.grpc_errors import error_from_rpc
from services.common.proto.qos.v1 import scheduler_pb2, worker_pb2

log = logging.getLogger(__name__)

# A worker drops an ended sequence with the scheduler's next step: until then it refuses to swap
# the adapter that sequence used (services/worker/adapters.py). Try again a few times.
WORKER_BUSY_TRIES, WORKER_BUSY_WAIT_S = 5, 0.1


class PoolAdapters:
    def __init__(self, pool_name: str, batcher):
        self.pool_name = pool_name
        self.batcher = batcher
        self.runtime: dict[str, str] = {}     # loaded at run time (name -> path): also onto later workers
        self.loading = asyncio.Lock()         # one load at a time: a reload and sync() never cross

    def held(self) -> frozenset[str]:
        """LoRA adapters some connected worker of the pool holds."""
        return frozenset().union(*(l.adapters for l in self.batcher.links if l.is_connected))

    def reply(self, missing: list[str] = ()) -> scheduler_pb2.AdaptersReply:
        infos = {a.name: a for l in self.batcher.links if l.is_connected and l.info
                 for a in l.info.adapters if a.name in l.adapters}
        for link in self.batcher.links:           # loaded since the link's Info: not in it
            for name in link.adapters - set(infos):
                infos[name] = worker_pb2.AdapterInfo(name=name, path=self.runtime.get(name, ""))
        return scheduler_pb2.AdaptersReply(pool=self.pool_name, adapters=sorted(infos.values(), key=lambda a: a.name),
                                           missing_on=list(missing))

    def users(self, name: str) -> tuple[int, int]:
        """(running, queued) requests of the pool naming the adapter."""
        running = sum(1 for seqs in self.batcher.running.values() for r in seqs if r.lora == name)
        policy = self.batcher.policy
        queued = sum(1 for lane in policy.lanes for r in policy.queue(lane) if r.lora == name)
        return running, queued

    async def load(self, name: str, path: str) -> scheduler_pb2.AdaptersReply:
        """Load on every connected worker; refused (the worker's reason) when none could."""
        held_adapters = self.batcher.planner.held_adapters
        if name in held_adapters:
            raise ServiceError(ErrorKind.CONFLICT, f"LoRA adapter {name!r} is being loaded in pool "
                               f"{self.pool_name}; retry once that load has answered", field="name",
                               retry_after_ms=1000, reason="adapter_in_use")
        if name in self.held():
            running, queued = self.users(name)
            if running or queued:
                raise ServiceError(
                    ErrorKind.CONFLICT, f"LoRA adapter {name!r} is loaded and used by {running} running and "
                    f"{queued} queued request(s) in pool {self.pool_name}: reload it once they finish (stop "
                    "sending requests naming it first), or load the new weights under a new name",
                    field="name", retry_after_ms=1000, reason="adapter_in_use")
        held_adapters.add(name)
        try:
            async with self.loading:
                return await self._swap(name, path)
        finally:
            held_adapters.discard(name)
            self.batcher.wakeup.set()

    async def _swap(self, name: str, path: str) -> scheduler_pb2.AdaptersReply:
        links = [l for l in self.batcher.links if l.is_connected]
        if not links:
            raise ServiceError(ErrorKind.UNAVAILABLE, f"pool {self.pool_name} has no worker to load "
                               "the adapter on", retry_after_ms=1000, reason="no_worker")
        results = await asyncio.gather(*(self._load_on(l, name, path) for l in links), return_exceptions=True)
        failed = [(l, r) for l, r in zip(links, results) if isinstance(r, BaseException)]
        for reply in results:
            if not isinstance(reply, BaseException):
                for dropped in reply.dropped:    # the pool forgets what its workers dropped (LRU)
                    self.runtime.pop(dropped, None)
        if len(failed) == len(links):
            raise failed[0][1]
        for link, _ in failed:
            await self._forget_on(link, name)
        if self.batcher.prefix_cache is not None:    # new weights: its blocks from before are not theirs
            self.batcher.prefix_cache.adapter_loaded(name)
        self.runtime[name] = path
        return self.reply([f"{l.address}: {r.message if isinstance(r, ServiceError) else r}" for l, r in failed])

    async def _load_on(self, link, name: str, path: str) -> worker_pb2.LoadAdapterReply:
        for attempt in range(WORKER_BUSY_TRIES):
            try:
                return await link.load_adapter(name, path)
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc, f"worker {link.address}")
            except ServiceError as exc:
                error = exc
            if error.reason != "adapter_in_use" or attempt == WORKER_BUSY_TRIES - 1:
                raise error
            await asyncio.sleep(WORKER_BUSY_WAIT_S)

    async def _forget_on(self, link, name: str) -> None:
        """A worker that kept the old weights under `name`: drop them (or at least stop sending
        it requests naming it); sync() loads the new ones on it later."""
        if name in link.adapters:
            try:
                await link.unload_adapter(name)
            except (grpc.aio.AioRpcError, ServiceError) as exc:
                log.warning("worker %s keeps old weights of adapter %s: %s", link.address, name, exc)
        link.adapters = link.adapters - {name}

    async def unload(self, name: str) -> scheduler_pb2.AdaptersReply:
        holding = [l for l in self.batcher.links if l.is_connected and name in l.adapters]
        if not holding:
            raise ServiceError(ErrorKind.NOT_FOUND, f"LoRA adapter {name!r} is not loaded in pool "
                               f"{self.pool_name}", field="name")
        running, _ = self.users(name)
        if running:
            raise ServiceError(ErrorKind.CONFLICT, f"LoRA adapter {name!r} is used by {running} running "
                               "sequence(s) in this pool; unload it once they finish", field="name",
                               reason="adapter_in_use")
        for link in holding:
            try:
                await link.unload_adapter(name)
            except grpc.aio.AioRpcError as exc:
                raise error_from_rpc(exc, f"worker {link.address}") from None
        self.runtime.pop(name, None)
        dropped = self.batcher.fail_waiting(lambda r: r.lora == name, ServiceError(
            ErrorKind.UNSUPPORTED, f"LoRA adapter {name!r} was unloaded from pool {self.pool_name} "
            "while the request waited", field="x-lora", reason="unknown_adapter"))
        if dropped:
            log.warning("adapter %s unloaded: %d queued request(s) naming it refused", name, dropped)
        return self.reply()

    async def sync(self) -> None:
        """Run-time adapters onto connected workers that lack them (joined later, or failed a load)."""
        async with self.loading:
            for link in [l for l in self.batcher.links if l.is_connected]:
                for name, path in list(self.runtime.items()):
                    if name in link.adapters or name not in self.runtime:
                        continue
                    try:
                        reply = await link.load_adapter(name, path)
                        for dropped in reply.dropped:
                            self.runtime.pop(dropped, None)
                    except grpc.aio.AioRpcError as exc:
                        log.warning("worker %s could not load adapter %s: %s", link.address, name, exc.details())
