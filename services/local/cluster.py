"""Start a local cluster (workers, scheduler, router) as separate processes on loopback.

Used by `qos-serve up`, the demo and the end-to-end tests. Ports given as 0 are resolved to free
ones first; the resolved config is written to a file every process reads. Children die with the
parent (PR_SET_PDEATHSIG), so nothing is left behind even if the parent is killed. With
`supervise=True` (`qos-serve up`, the demo) a process that exits is restarted
(services/local/supervisor.py); without it (the tests that kill processes on purpose) it stays down.
"""
from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


from services.common.cluster_auth import TOKEN_ENV, ClusterTrust, make_tokens, write_tokens
from services.common.config import ClusterConfig
from services.common.grpc_server import wait_healthy
from services.common.ports import free_port
from services.common.process_status import PROCESSES_FILE_ENV
from services.common.proto.qos.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 10.0           # beyond the drain time, before a service is killed


def resolve_model(model: str, progress: bool = True) -> str:
    if model == "default":
        from services.engine.default_model import default_model_dir  # no torch import here
        return str(default_model_dir(progress=progress))
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"model folder {model} has no config.json")
    return str(Path(model).resolve())


class PortPicker:
    """Free ports, a different one for each: a port freed a moment ago may be handed out again by
    the next bind(0)."""

    def __init__(self, config: ClusterConfig):
        sections = [config.router] + [s for pool in config.pools for s in (pool.scheduler, *pool.workers)]
        self.taken = {s.port for s in sections} | {s.metrics_port for s in sections} | {config.router.http_port}

    def fresh(self, host: str) -> int:
        while (port := free_port(host)) in self.taken:
            pass
        self.taken.add(port)
        return port


def resolve_ports(config: ClusterConfig) -> ClusterConfig:
    """Port 0 -> a free port."""
    config = dataclasses.replace(config)
    picker = PortPicker(config)
    for section in [config.router] + [s for pool in config.pools for s in (pool.scheduler, *pool.workers)]:
        if section.port == 0:
            section.port = picker.fresh(section.host)
        if section.metrics_port == 0:
            section.metrics_port = picker.fresh(section.host)
    if config.router.http_port == 0:
        config.router.http_port = picker.fresh(config.router.host)
    return config


@dataclasses.dataclass(slots=True, frozen=True)
class RouterReplica:
    """A router beyond the first ([auth] replicas > 1): the same config, its own ports."""
    name: str
    port: int
    http_port: int
    metrics_port: int | None

    def args(self) -> tuple[str, ...]:
        return ("router", "--port", str(self.port), "--http-port", str(self.http_port),
                *(("--metrics-port", str(self.metrics_port)) if self.metrics_port is not None else ()))


def router_replicas(config: ClusterConfig) -> list[RouterReplica]:
    picker, host = PortPicker(config), config.router.host
    return [RouterReplica(f"router-{i + 1}", picker.fresh(host),
                          picker.fresh(host) if config.router.http_port >= 0 else -1,
                          picker.fresh(host) if config.router.metrics_port is not None else None)
            for i in range(1, config.auth.replicas)]


PARENT_PID_ENV = "QOS_SERVE_PARENT_PID"


def die_with_parent_if_asked() -> None:
    """In a process LocalCluster started: get SIGTERM when the launcher exits, however it exits
    (Linux PR_SET_PDEATHSIG). Done by the child itself after exec rather than in a preexec_fn:
    running Python between fork and exec in a process with gRPC threads could abort the child
    (seen as a service dying with SIGABRT at start-up, about one start in three in a test that
    runs a gRPC server in the launching process)."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is not None:
        die_with_parent(int(parent))


def die_with_parent(parent: int) -> None:
    """Get SIGTERM when process `parent` (this one's parent) exits, however it exits, killed
    included (Linux PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:    # the parent died before prctl: nothing would signal us
        os.kill(os.getpid(), signal.SIGTERM)


class LocalCluster:
    """with LocalCluster(config) as cluster: ... cluster.router_address ..."""

    def __init__(self, config: ClusterConfig, log_dir: Path | None = None, quiet: bool = False,
                 autoscale: bool = False, supervise: bool = False, restart_policy=None):
        self.config = resolve_ports(config)
        self.config.model = resolve_model(self.config.model, progress=not quiet)
        self.replicas = router_replicas(self.config)      # routers beyond the first
        self._tmp = tempfile.TemporaryDirectory(prefix="qos-serve-")
        self.config_path = Path(self._tmp.name) / "cluster.json"
        if not self.config.security.tokens_dir and not os.environ.get(TOKEN_ENV):
            self.config.security.tokens_dir = str(self._make_tokens())
        self.trust = ClusterTrust.load(self.config.security, "admin")   # our own calls: the stats, the autoscaler
        self.config.write_json(self.config_path)
        self.log_dir = log_dir or Path(self._tmp.name)
        self.quiet = quiet
        self.processes: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, tuple[str, ...]] = {}      # name -> its `qos-serve` arguments
        self.autoscale = autoscale
        self.autoscaler = None           # LocalAutoscaler, with --autoscale
        self.supervise = supervise
        self.restart_policy = restart_policy
        self.supervisor = None           # Supervisor, with supervise=True
        self.processes_file = Path(self._tmp.name) / "processes.json"
        self._supervising = threading.Event()
        self._supervisor_thread: threading.Thread | None = None

    def _make_tokens(self) -> Path:
        """No tokens configured: one per role for this cluster alone, readable only by us (and our
        children). Each process reads its own role's (they all run as one user on one machine
        here: the roles are told apart, not hidden from each other)."""
        path = Path(self._tmp.name) / "tokens"
        write_tokens(path, make_tokens())
        return path

    @property
    def router_address(self) -> str:
        return self.config.router.address

    @property
    def router_addresses(self) -> list[str]:
        """Every router replica's gRPC address, the first one's first."""
        return [self.router_address] + [f"{self.config.router.host}:{r.port}" for r in self.replicas]

    @property
    def router_http_addresses(self) -> list[str]:
        return [f"{self.config.router.host}:{port}" for port in
                [self.config.router.http_port] + [r.http_port for r in self.replicas] if port >= 0]

    @property
    def scheduler_address(self) -> str:
        """The first pool's scheduler."""
        return self.config.pools[0].scheduler.address

    @staticmethod
    def worker_name(pool: str, index: int) -> str:
        return f"{pool}/worker-{index}"

    def launch(self, name: str, *args: str) -> subprocess.Popen:
        """One `qos-serve` service process on this cluster's config (dies with us)."""
        command = [sys.executable, "-m", "services.tools.cli", *args, "--config", str(self.config_path)]
        stream = open(self.log_dir / f"{name.replace('/', '-')}.log", "ab") if self.quiet else None
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid()), PROCESSES_FILE_ENV: str(self.processes_file)}
        return subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT if stream else None, env=env)

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        """A service the cluster cannot do without: watched, and stopped with the cluster."""
        self.processes[name] = process = self.launch(name, *args)
        self.commands[name] = args
        return process

    def relaunch(self, name: str) -> subprocess.Popen:
        """The same service again, with the same arguments (the supervisor's restart)."""
        return self._spawn(name, *self.commands[name])

    def start_worker(self, pool: str, index: int) -> subprocess.Popen:
        return self._spawn(self.worker_name(pool, index), "worker", "--pool", pool, "--index", str(index))

    def start_scheduler(self, pool: str) -> subprocess.Popen:
        return self._spawn(f"{pool}/scheduler", "scheduler", "--pool", pool)

    def start(self) -> "LocalCluster":
        try:
            for pool in self.config.pools:
                for i in range(len(pool.workers)):
                    self.start_worker(pool.name, i)
                self.start_scheduler(pool.name)
            self._spawn("router", "router")
            for replica in self.replicas:
                self._spawn(replica.name, *replica.args())
            asyncio.run(self._wait_ready())
            if self.supervise:
                self._start_supervisor()
            if self.autoscale:
                from services.local.autoscaler import LocalAutoscaler
                self.autoscaler = LocalAutoscaler(self, say=lambda line: print(line, flush=True)).start()
        except BaseException:
            self.stop()
            raise
        return self

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        addresses = []
        for pool in self.config.pools:
            addresses += [(self.worker_name(pool.name, i), w.address) for i, w in enumerate(pool.workers)]
            addresses.append((f"{pool.name}/scheduler", pool.scheduler.address))
        for name, address in addresses:
            self._check_alive()
            role = "scheduler" if name.endswith("/scheduler") else "worker"
            if not await wait_healthy(address, timeout=deadline - time.monotonic(), trust=self.trust,
                                      peer_role=role):
                raise TimeoutError(f"{name} at {address} did not become healthy")
        # Healthy is not enough for a scheduler: it must also have connected to every worker.
        for pool in self.config.pools:
            async with self.trust.channel(pool.scheduler.address, "scheduler") as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                while (await stub.GetPoolStats(scheduler_pb2.PoolStatsRequest(),
                                               metadata=self.trust.metadata)).workers < len(pool.workers):
                    self._check_alive()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"pool {pool.name}: the scheduler did not connect to all its workers")
                    await asyncio.sleep(0.1)
        # A router reports SERVING once it knows every pool's model and limits.
        for address in self.router_addresses:
            if not await wait_healthy(address, timeout=deadline - time.monotonic(),
                                      ca_file=self.config.router.tls_cert or None):
                raise TimeoutError(f"router at {address} did not become healthy")

    def _start_supervisor(self) -> None:
        from services.local.supervisor import RestartPolicy, Supervisor
        self.supervisor = Supervisor(self.processes, self.relaunch, self.restart_policy or RestartPolicy(),
                                     status_file=self.processes_file,
                                     say=lambda line: print(line, file=sys.stderr, flush=True))

        def watch() -> None:
            while not self._supervising.wait(0.2):
                self.supervisor.check()

        self._supervisor_thread = threading.Thread(target=watch, name="supervisor", daemon=True)
        self._supervisor_thread.start()

    async def pool_stats(self, pool: str | None = None) -> scheduler_pb2.PoolStats:
        """A pool's stats from its scheduler (the first pool's by default), with our token."""
        async with self.trust.channel(self.config.pool(pool).scheduler.address, "scheduler") as channel:
            return await scheduler_pb2_grpc.SchedulerStub(channel).GetPoolStats(
                scheduler_pb2.PoolStatsRequest(), metadata=self.trust.metadata)

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {process.returncode} during start-up"
                                   + (f"; see {self.log_dir / (name + '.log')}" if self.quiet else ""))

    def drain_seconds(self) -> float:
        """The longest any service may take to drain after SIGTERM."""
        sections = [self.config.router] + [s for p in self.config.pools for s in (p.scheduler, *p.workers)]
        return max(s.drain_seconds for s in sections)

    def stop(self) -> None:
        """SIGTERM everything: each service drains (finishes what is in flight, takes nothing new)
        and exits; SIGKILL what is still there after the longest drain time."""
        self._supervising.set()          # first: nothing is restarted while the cluster stops
        if self._supervisor_thread is not None:
            self._supervisor_thread.join()
        if self.autoscaler is not None:
            self.autoscaler.stop()
            self.autoscaler.stop_extras(self.drain_seconds() + STOP_TIMEOUT_SECONDS)
        for process in reversed(list(self.processes.values())):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_seconds() + STOP_TIMEOUT_SECONDS
        for name, process in self.processes.items():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                process.kill()
                process.wait()
        self.processes.clear()

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def run_until_signal(cluster: LocalCluster) -> None:
    """`qos-serve up`: start, print where things are, stop cleanly on Ctrl-C or SIGTERM."""
    stop = False

    def request_stop(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    with cluster:
        pools = ", ".join(f"{p.name} ({p.device}, scheduler {p.scheduler.address}, "
                          f"{len(p.workers)} worker(s))" for p in cluster.config.pools)
        print(f"qos-serve up: router {', '.join(cluster.router_addresses)}; "
              f"pools: {pools}; model "
              f"{Path(cluster.config.model).name}. Ctrl-C stops.", flush=True)
        router = cluster.config.router
        if router.http_port > 0:
            key = cluster.config.auth.admin_key
            print(f"qos-serve up: console http://{router.host}:{router.http_port}/console"
                  + (f" (admin key {key})" if key else " (the admin key: $QOS_ADMIN_KEY)"), flush=True)
        while not stop:      # the supervisor restarts what exits; only a signal stops the cluster
            time.sleep(0.2)
        print("stopping...", flush=True)
    print("stopped", flush=True)
