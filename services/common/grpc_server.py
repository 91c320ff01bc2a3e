"""Running a grpc.aio server the same way in every service: health service, error mapping,
signals, graceful drain."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from services.common.cluster_auth import ClusterTrust
from services.common.cluster_roles import RoleInterceptor
from services.common.drain import Drain
from services.common.gc_pauses import freeze_startup_heap
from services.common.grpc_errors import ServiceErrorInterceptor

log = logging.getLogger(__name__)

LIVENESS_SERVICE = "liveness"     # health service name that stays SERVING while the process lives

# After the drain: a moment for the last responses to be flushed before open calls are cancelled.
STOP_GRACE_SECONDS = 1.0
KEEPALIVE_MS = 10_000


def channel_options(keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, int]]:
    """Small messages, many streams: keepalive notices a vanished peer even on a quiet connection."""
    return [
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", min(5_000, keepalive_ms)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.max_receive_message_length", 64 * 2**20),
        ("grpc.max_send_message_length", 64 * 2**20),
    ]


def server_options(keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, int]]:
    """The channel's options, and a server that accepts those keepalive pings on a stream that
    carries no data. gRPC servers by default accept such pings only every 5 minutes and hang up
    with GOAWAY "too_many_pings" after a few: a request waiting minutes for its first token (a
    Low one in a long queue) failed with UNAVAILABLE "Too many pings" after ~140 s.

    And no SO_REUSEPORT (gRPC's default on Linux): with it, a second server started on a port in
    use binds as well and the kernel splits new connections between the two, so calls meant for
    a scheduler reach a worker and fail with "Method not found" (seen once in CI; most likely two
    services of one test cluster given the same free port). Without it, the second fails to start."""
    return channel_options(keepalive_ms) + [
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2), ("grpc.so_reuseport", 0)]


CHANNEL_OPTIONS = channel_options()
# A channel polling a service that is starting: gRPC waits 1 s after the first refused connection,
# then 1.6, 2.6 s... before it tries again, so a service that began listening just after the first
# try was seen as healthy up to seconds late (a local cluster's start waited ~1.5 s on it).
POLL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 250)]
SERVER_OPTIONS = server_options()
# Scheduler <-> worker: a worker machine that vanishes without closing its connection (power, a
# network partition) is noticed within ~4 s even in the middle of a long step; a process that
# dies closes its connection and is noticed at once.
WORKER_KEEPALIVE_MS = 2_000
WORKER_CHANNEL_OPTIONS = channel_options(WORKER_KEEPALIVE_MS)
WORKER_SERVER_OPTIONS = server_options(WORKER_KEEPALIVE_MS)


def add_port(server: grpc.aio.Server, name: str, address: str, tls: tuple[str, str] | None,
             trust: ClusterTrust | None = None) -> int:
    """Listen on `address`, with TLS where `tls` = (certificate chain, private key) PEM files, or
    mutual TLS where `trust` has the cluster's certificates; the port bound. OSError naming the
    service when it cannot bind."""
    credentials = trust.server_credentials() if trust is not None else None
    if credentials is not None:
        port = server.add_secure_port(address, credentials)
    elif tls is None:
        port = server.add_insecure_port(address)
    else:
        cert, key = (Path(p).expanduser().read_bytes() for p in tls)
        port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    if port == 0:
        raise OSError(f"{name}: cannot bind {address}")
    return port


async def run_server(name: str, address: str, register: Callable[[grpc.aio.Server], list[str]],
                     drain: Drain, on_started: Callable[[int], Awaitable[None]] | None = None,
                     on_stopping: Callable[[], Awaitable[None]] | None = None,
                     ready: asyncio.Event | None = None, options=SERVER_OPTIONS,
                     tls: tuple[str, str] | None = None, trust: ClusterTrust | None = None,
                     gates: Sequence[grpc.aio.ServerInterceptor] = ()) -> None:
    """Serve until SIGTERM/SIGINT (or drain.request()), then drain (services/common/drain.py) and stop.

    `register` adds the servicers and returns their full service names, which the standard
    grpc.health.v1 service reports as SERVING once `ready` is set (at once without one), and
    NOT_SERVING from the moment the drain begins. Handlers raise ServiceError; the interceptor
    turns it into the status. `on_stopping` runs after the drain, before the server stops: the
    service's own loops and channels are needed until the last request in flight is done.
    `gates`: interceptors that see every call before its handler, and before its request message
    is read (the router's CallerGate).
    `trust` (schedulers and workers): every call but health checks from a role the method is for,
    proven by its token and/or certificate (services/common/cluster_roles.py), over mutual TLS
    where the cluster has certificates; with neither, on loopback only (cluster_auth.py)."""
    interceptors = [*gates, ServiceErrorInterceptor()]
    if trust is not None:
        trust.refuse_open(name, address)
        if trust.guarded:
            interceptors.insert(0, RoleInterceptor(trust))
    server = grpc.aio.server(options=options, interceptors=interceptors)
    services = register(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for service in ["", *services]:   # the stock servicer starts "" as SERVING; not yet
        await health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    port = add_port(server, name, address, tls, trust)
    await server.start()
    # Alive from now until the process stops, draining included: what a liveness probe asks
    # (`grpc: {service: liveness}` on Kubernetes), while readiness asks "" (NOT_SERVING on drain).
    await health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s listening on %s", name, address.rsplit(":", 1)[0] + f":{port}")
    if on_started is not None:
        await on_started(port)

    async def report_serving() -> None:
        if ready is not None:
            await ready.wait()
        for service in ["", *services]:
            await health.set(service, health_pb2.HealthCheckResponse.SERVING)
        # What exists now lives as long as the process: out of the collector's scans (gc_pauses.py).
        freeze_startup_heap(name)

    serving_task = asyncio.create_task(report_serving())

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain.request)
    serving = asyncio.create_task(server.wait_for_termination())
    stopping = asyncio.create_task(drain.requested.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    serving_task.cancel()
    for service in ["", *services]:
        await health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    drain.begin()
    if not serving.done():
        finished = await drain.wait_idle()
        log.info("%s drained (%s); stopping", name, "all requests finished" if finished
                 else f"{drain.in_flight} still in flight after {drain.seconds:.0f} s")
    if on_stopping is not None:
        await on_stopping()
    # What is left are long-lived watch streams (stats, health): they end now.
    await server.stop(STOP_GRACE_SECONDS)
    stopping.cancel()
    log.info("%s stopped", name)


def open_channel(address: str, ca_file: str | None = None, options=CHANNEL_OPTIONS) -> grpc.aio.Channel:
    """A channel to one of our services: TLS, trusting `ca_file` (PEM), when given."""
    if not ca_file:
        return grpc.aio.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(ca_file).expanduser().read_bytes())
    return grpc.aio.secure_channel(address, credentials, options=options)


async def wait_healthy(address: str, timeout: float, service: str = "", ca_file: str | None = None,
                       trust: ClusterTrust | None = None, peer_role: str = "") -> bool:
    """Poll grpc.health.v1 Check until SERVING or `timeout` seconds pass. `trust` and
    `peer_role`: a scheduler or worker, over the cluster's mutual TLS where it has one."""
    deadline = asyncio.get_running_loop().time() + timeout
    channel = (trust.channel(address, peer_role, POLL_OPTIONS) if trust is not None
               else open_channel(address, ca_file, CHANNEL_OPTIONS + POLL_OPTIONS))
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.1)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
