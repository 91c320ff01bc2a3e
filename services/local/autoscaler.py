"""`qos-serve up --autoscale`: act on each pool's `desired_workers` on one machine.

Once a second the launcher reads every scalable pool's stats (min_workers < max_workers). When
the pool wants more workers than it has, it starts extra CPU workers that join the pool at run
time (`qos-serve worker --join`, the membership of the issue "No lost request"); when it wants
fewer, it drains the newest extra worker (Worker.Drain: it takes no new sequences, finishes the
ones it holds, then leaves), so a scale-in loses no request. The configured workers are never
removed: they are the pool's floor.

On Kubernetes the same `qos_desired_workers{pool}` drives a KEDA ScaledObject instead.
"""
from __future__ import annotations

import logging
import subprocess
import threading
import time
from dataclasses import dataclass

import grpc

from services.common.ports import free_port
from services.common.proto.qos.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class ExtraWorker:
    name: str
    address: str
    process: subprocess.Popen
    draining: bool = False


class LocalAutoscaler:
    def __init__(self, cluster, interval_s: float = 1.0, say=print):
        self.cluster = cluster
        self.interval_s = interval_s
        self.say = say                  # one line per action, for the person watching `qos-serve up`
        self.pools = [p for p in cluster.config.pools if p.worker_limits()[1] > p.worker_limits()[0]]
        self.extras: dict[str, list[ExtraWorker]] = {p.name: [] for p in self.pools}
        self.started = 0
        self.workers_max = {p.name: len(p.workers) for p in self.pools}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="autoscaler", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> "LocalAutoscaler":
        if self.pools:
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop deciding; the extra workers stop with the cluster (drained by SIGTERM)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            for pool in self.pools:
                try:
                    self.tick(pool)
                except grpc.RpcError as exc:       # the scheduler restarting, or stopping with us
                    log.debug("autoscaler: pool %s: %s", pool.name, exc)

    def serving(self, pool_name: str) -> int:
        """Workers the launcher runs for the pool and has not asked to leave."""
        pool = self.cluster.config.pool(pool_name)
        extras = [e for e in self.extras[pool_name] if not e.draining]
        return len(pool.workers) + len(extras)

    def tick(self, pool) -> None:
        trust = self.cluster.trust
        with trust.sync_channel(pool.scheduler.address, "scheduler") as channel:
            stats = scheduler_pb2_grpc.SchedulerStub(channel).GetPoolStats(scheduler_pb2.PoolStatsRequest(), timeout=5,
                                                                           metadata=trust.metadata)
        with self._lock:
            self._reap(pool.name)
            have = self.serving(pool.name)
            if stats.desired_workers > have:
                for _ in range(stats.desired_workers - have):
                    self._start_extra(pool)
                self.say(f"autoscale: pool {pool.name}: {have} -> {stats.desired_workers} workers "
                         f"({stats.scale_reason})")
            elif stats.desired_workers < have and self._drain_newest(pool.name):
                self.say(f"autoscale: pool {pool.name}: {have} -> {have - 1} workers ({stats.scale_reason})")
            self.workers_max[pool.name] = max(self.workers_max[pool.name], stats.workers)

    def _start_extra(self, pool) -> None:
        port = free_port(pool.workers[0].host)
        self.started += 1
        name = f"{pool.name}/worker-auto{self.started}"
        process = self.cluster.launch(name, "worker", "--pool", pool.name, "--index", "0",
                                      "--port", str(port), "--join", pool.scheduler.address)
        self.extras[pool.name].append(ExtraWorker(name, f"{pool.workers[0].host}:{port}", process))

    def _drain_newest(self, pool_name: str) -> bool:
        live = [e for e in self.extras[pool_name] if not e.draining]
        if not live:
            return False
        extra = live[-1]
        extra.draining = True
        try:
            trust = self.cluster.trust
            with trust.sync_channel(extra.address, "worker") as channel:
                worker_pb2_grpc.WorkerStub(channel).Drain(worker_pb2.DrainRequest(), timeout=5, metadata=trust.metadata)
        except grpc.RpcError:
            extra.process.terminate()       # still loading its model: SIGTERM drains it as well
        return True

    def _reap(self, pool_name: str) -> None:
        for extra in list(self.extras[pool_name]):
            if extra.process.poll() is not None:
                if not extra.draining:
                    log.warning("autoscaler: %s exited with code %s", extra.name, extra.process.returncode)
                self.extras[pool_name].remove(extra)

    def stop_extras(self, timeout_s: float) -> None:
        """Drain every extra worker (as SIGTERM does) and wait for them to leave."""
        with self._lock:
            extras = [e for pool in self.extras.values() for e in pool]
        for extra in extras:
            if extra.process.poll() is None:
                extra.process.terminate()
        deadline = time.monotonic() + timeout_s
        for extra in extras:
            try:
                extra.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                extra.process.kill()
                extra.process.wait()
