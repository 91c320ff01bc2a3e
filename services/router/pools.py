"""The pools as the router sees them: one scheduler stub and link each, and a cache of their stats
kept fresh by one WatchPoolStats stream per pool. The request path reads only this cache (no RPC on
the routing decision)."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common.cluster_auth import ClusterTrust, no_trust
from services.common.config import PoolConfig
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.proto.qos.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.router.latency_model import PoolReport
from services.router.routing import PoolLoad, PoolRouter, PoolSpec
from services.router.scheduler_link import SchedulerLink

log = logging.getLogger(__name__)

POOL_GRACE_S = 5.0             # how long the router waits for every pool before serving without some
STATS_INTERVAL_MS = 200


class PoolHandle:
    """One pool: its scheduler stub, the link requests go on, and its latest stats."""

    def __init__(self, config: PoolConfig, trust: ClusterTrust):
        self.config = config
        self.channel = trust.channel(config.scheduler.address, "scheduler", CHANNEL_OPTIONS)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.metadata = trust.metadata          # every call to the scheduler carries it
        self.link = SchedulerLink(self.scheduler, self.peer, self.metadata)     # requests over one stream
        self.stats: scheduler_pb2.PoolStats | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def peer(self) -> str:
        """How errors name it when it cannot be reached."""
        return f"pool {self.name} scheduler {self.config.scheduler.address} unavailable"

    @property
    def known(self) -> bool:
        return self.stats is not None and self.stats.max_context > 0


def pool_load(stats: scheduler_pb2.PoolStats) -> PoolLoad:
    """A draining pool is healthy no more: it finishes what it has and takes nothing new."""
    total = stats.kv_blocks_total or 1
    classes = stats.classes
    report = PoolReport(
        step_seconds=stats.step_seconds, worker_steps=stats.worker_steps, step_tokens=stats.step_tokens,
        step_kv_tokens=stats.step_kv_tokens, steps=stats.steps, finished=stats.finished, at_s=time.monotonic(),
        kv_capacity=stats.kv_blocks_total * stats.block_size,
        kv_tokens=stats.kv_blocks_used * stats.block_size,
        kv_by_class=tuple(c.kv_blocks * stats.block_size for c in classes), kv_caps=tuple(c.kv_cap for c in classes),
        waiting=tuple(c.waiting for c in classes),
        waiting_tokens=tuple(c.waiting_tokens for c in classes), running=tuple(c.running for c in classes),
        weights=tuple(c.weight for c in classes), workers=max(stats.workers - stats.workers_draining, 1),
        max_step_tokens=stats.max_step_tokens, max_running=stats.max_running) \
        if len(classes) == 3 and stats.max_step_tokens else None
    return PoolLoad(healthy=stats.workers > stats.workers_draining and not stats.draining,
                    queued=sum(c.waiting for c in classes),
                    free_kv=1.0 - stats.kv_blocks_used / total, ttft_ms=stats.ttft_p90_ms,
                    utilization=stats.utilization, adapters=frozenset(stats.adapters), report=report)


class PoolDirectory:
    def __init__(self, pools: list[PoolConfig], model_name: str, routing: str, trust: ClusterTrust | None = None):
        trust = trust or no_trust("router")
        self.handles = {p.name: PoolHandle(p, trust) for p in pools}
        self.router = PoolRouter([PoolSpec(p.name, p.device, frozenset({model_name}),
                                           p.cost_per_token, p.lora, p.primary) for p in pools],
                                 mode=routing)
        self.specs = {spec.name: spec for spec in self.router.pools}
        self.ready = asyncio.Event()      # every pool known, or some after POOL_GRACE_S
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._watch(h)) for h in self.handles.values()]
        self.tasks.append(asyncio.create_task(self._serve_without_missing_pools()))

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for handle in self.handles.values():
            handle.link.close()
            await handle.channel.close()

    def max_context(self) -> int | None:
        known = [h.stats.max_context for h in self.handles.values() if h.known]
        return min(known) if known else None

    def adapter_names(self) -> set[str]:
        """LoRA adapters some pool holds now (from the cache)."""
        return {a for h in self.handles.values() if h.stats is not None for a in h.stats.adapters}

    def latest_stats(self) -> list[scheduler_pb2.PoolStats]:
        return [h.stats for h in self.handles.values() if h.stats is not None]

    async def _serve_without_missing_pools(self) -> None:
        """Ready at once when every pool answers; after POOL_GRACE_S, ready with those that do.
        A pool that is down (or not started, as in docker compose without its profile) is
        unhealthy and gets no requests until it answers."""
        while not self.ready.is_set():
            await asyncio.sleep(POOL_GRACE_S)
            known = [n for n, h in self.handles.items() if h.known]
            if known and not self.ready.is_set():
                missing = sorted(set(self.handles) - set(known))
                log.warning("serving with pool(s) %s; no answer yet from %s", ", ".join(known),
                            ", ".join(missing))
                self.ready.set()

    async def _watch(self, handle: PoolHandle) -> None:
        """Cache a pool's stats (model, limits, load); reconnect when its stream breaks."""
        while True:
            try:
                async for stats in handle.scheduler.WatchPoolStats(
                        scheduler_pb2.PoolStatsRequest(interval_ms=STATS_INTERVAL_MS), metadata=handle.metadata):
                    self._update(handle, stats)
            except grpc.aio.AioRpcError as exc:
                log.debug("pool %s stats stream: %s", handle.name, exc.code().name)
            self.router.update(handle.name, PoolLoad(healthy=False))
            await asyncio.sleep(STATS_INTERVAL_MS / 1000)

    def _update(self, handle: PoolHandle, stats: scheduler_pb2.PoolStats) -> None:
        if stats.device and stats.device != handle.config.device:
            log.error("pool %s is configured as %s but its workers run on %s; not routing to it",
                      handle.name, handle.config.device, stats.device)
            self.router.update(handle.name, PoolLoad(healthy=False))
            return
        handle.stats = stats
        self.router.update(handle.name, pool_load(stats))
        if all(h.known for h in self.handles.values()):
            self.ready.set()
