"""Load generation for the QoS benchmark (bench/qos_burst.py): each traffic class is sent by a
client process of its own.

Why separate processes: chat users and batch jobs are different clients. One asyncio client that
sends a 1,000-request burst spends its event loop on the flood's streams, and a High request's
measured TTFT then includes waiting for the benchmark's own client, not for the server (measured
at full scale of bench/qos_burst.py: up to ~450 ms between a High request's send time and the
router seeing it). Each process waits for one common start time and sends its jobs at their
offsets; times are measured inside the process that sent the request.

    from bench.loadgen import Front, Job, run_clients
    outcomes, start = await run_clients(Front.of("grpc", cluster), jobs, on_progress=bar.update)

`Front.of("http", cluster)` sends the same jobs through the OpenAI-compatible HTTP front instead
(bench/http_client.py): both fronts, same clients, same measurements.

The client processes are started with the "spawn" method and run `bench.loadgen._client_main`, so
this module must be imported as `bench.loadgen` with the repository root on sys.path (the bench
scripts put it there; spawn hands the parent's sys.path to its children).
"""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from services.local.cluster import die_with_parent

START_MARGIN_S = 0.2          # every client gets the start time this far ahead
# Client processes stand in for clients on other machines: at a lower CPU priority, they take the
# shared cores only when the services under test do not need them (without it, the flood's two
# client processes slowed the router's intake of a 1,000-request burst: High P99 TTFT 454 ms vs
# 241 ms in the same configuration). Except High's: its few requests load nobody, and a client
# niced while the services keep both cores busy reads its first chunk late, which counted against
# the service (one burst pair, 2026-12-01: High's time outside the scheduler, router and client,
# max 26 ms niced against 19 ms at normal priority; idle, ~6 ms).
CLIENT_NICE = 10
UNNICED = {"high"}


@dataclass(slots=True, frozen=True)
class Front:
    """Where the clients send: the router's gRPC address, or its HTTP front (which needs the
    model's name in every body); and the cores the client processes run on (none: anywhere)."""
    kind: str                     # "grpc" or "http"
    address: str                  # host:port
    model: str = ""

    @classmethod
    def of(cls, kind: str, cluster) -> "Front":
        """The cluster's router."""
        router = cluster.config.router
        if kind == "http":
            return cls("http", f"{router.host}:{router.http_port}", Path(cluster.config.model).name)
        return cls("grpc", router.address)


@dataclass(slots=True)
class Job:
    priority: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    at: float                     # seconds after the common start
    tenant: str = ""              # sent as x-tenant (the router's accounting and tenant fairness)


@dataclass(slots=True)
class Outcome:
    priority: str
    ok: bool
    code: str = "OK"
    ttft_ms: float = 0.0          # measured by the client
    server_ttft_ms: float = 0.0   # measured by the scheduler (arrival there -> first token)
    server_queue_ms: float = 0.0  # ... arrival there -> first scheduled in a step
    e2e_ms: float = 0.0
    tokens: int = 0
    sent_at: float = 0.0          # seconds after the common start
    send_lag_ms: float = 0.0      # how much later than its scheduled time the client sent it
    done_at: float = 0.0
    detail: str = ""              # the error message, for failures
    tenant: str = ""


def _grpc_sender(address: str):
    """(async context for the client, send(job) -> Outcome fields) over the router's gRPC."""
    import grpc

    from services.common.proto.qos.v1 import router_pb2
    from services.tools.client import RouterClient, sampling_params

    client = RouterClient(address)

    async def send(job: Job) -> Outcome:
        request = router_pb2.GenerateRequest(prompt=job.prompt, sampling=sampling_params(
            max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True))
        try:
            answer = await client.generate(request, priority=job.priority, tenant=job.tenant or None)
        except grpc.aio.AioRpcError as exc:
            return Outcome(job.priority, False, code=exc.code().name, detail=exc.details() or "")
        return Outcome(job.priority, True, ttft_ms=answer.ttft_ms, e2e_ms=answer.e2e_ms,
                       server_ttft_ms=answer.server_timings.ttft_ms,
                       server_queue_ms=answer.server_timings.queue_ms, tokens=len(answer.token_ids))

    return client, send


def _http_sender(address: str, model: str):
    """The same over the OpenAI-compatible HTTP front (bench/http_client.py). The scheduler's own
    TTFT does not travel over HTTP: server_ttft_ms and server_queue_ms are NaN."""
    from bench.http_client import HttpError, complete

    async def send(job: Job) -> Outcome:
        try:
            answer = await complete(address, model, job.prompt, job.max_tokens, job.priority, job.tenant,
                                    ignore_eos=True)
        except HttpError as exc:
            return Outcome(job.priority, False, code=exc.grpc_code, detail=f"{exc.code}: {exc.message}")
        return Outcome(job.priority, True, ttft_ms=answer.ttft_ms, e2e_ms=answer.e2e_ms,
                       server_ttft_ms=float("nan"), server_queue_ms=float("nan"), tokens=answer.completion_tokens)

    return contextlib.nullcontext(), send


async def _send(front: Front, jobs: list[Job], start: float, done) -> list[Outcome]:
    resource, send = (_http_sender(front.address, front.model) if front.kind == "http"
                      else _grpc_sender(front.address))
    async with resource:
        async def one(job: Job) -> Outcome:
            await asyncio.sleep(max(0.0, start + job.at - time.time()))
            sent_at = time.time() - start
            outcome = await send(job)
            outcome.sent_at, outcome.done_at, outcome.tenant = sent_at, time.time() - start, job.tenant
            # A client process short of CPU sends late, and the service sees a gentler load than
            # the workload says: the reports show how late (qos_report.summarise).
            outcome.send_lag_ms = max(0.0, sent_at - job.at) * 1000
            with done.get_lock():
                done.value += 1
            return outcome

        return list(await asyncio.gather(*(one(job) for job in jobs)))


def _client_main(front: Front, jobs: list[dict], done, conn, parent: int) -> None:
    """One client process: say ready, wait for the start time, send, return the outcomes."""
    # A benchmark killed (not interrupted) runs no cleanup: without this its clients went on
    # sending, and the cluster's services, told to drain, waited for their streams.
    die_with_parent(parent)
    if not jobs or jobs[0]["priority"] not in UNNICED:    # a process sends one priority's jobs
        os.nice(CLIENT_NICE)
    try:
        conn.send("ready")
        start = conn.recv()
        outcomes = asyncio.run(_send(front, [Job(**job) for job in jobs], start, done))
        conn.send([asdict(o) for o in outcomes])
    except BaseException as exc:   # the parent must hear of it rather than wait forever
        conn.send(RuntimeError(f"client process failed: {exc!r}"))
        raise


def _receive(process, conn):
    """The client's next message; a client that died without a word is named, with its exit code
    (its pipe reads as ready at its end, and a bare EOFError said nothing of which or why)."""
    try:
        return conn.recv()
    except EOFError:
        process.join(timeout=5)
        raise RuntimeError(f"{process.name} exited with {process.exitcode} without reporting "
                           "(its traceback is above)") from None


async def run_clients(front: Front, jobs: list[Job], on_progress: Callable[[int], None] | None = None,
                      until_done: set[str] | None = None) -> tuple[list[Outcome], float]:
    """Send `jobs` through the router's `front`, one client process per priority and tenant. Returns the
    outcomes and the common start time (time.time()). With `until_done` (priorities), returns once
    those priorities' clients have reported, with their outcomes only: the other clients are killed
    (their requests cancelled mid-stream, as by a client that goes away)."""
    context = multiprocessing.get_context("spawn")   # no fork of a process holding gRPC channels
    done = context.Value("i", 0)
    clients = []
    awaited = set()         # the client processes whose outcomes are returned
    for priority, tenant in sorted({(job.priority, job.tenant) for job in jobs}):
        ours, theirs = context.Pipe()
        group = [asdict(job) for job in jobs if (job.priority, job.tenant) == (priority, tenant)]
        process = context.Process(target=_client_main, args=(front, group, done, theirs, os.getpid()),
                                  name=f"client-{priority}{'-' + tenant if tenant else ''}", daemon=True)
        process.start()
        clients.append((process, ours))
        if until_done is None or priority in until_done:
            awaited.add(process)
    try:
        for process, conn in clients:
            while not conn.poll():
                if not process.is_alive():
                    raise RuntimeError(f"{process.name} exited with {process.exitcode} before starting")
                await asyncio.sleep(0.05)
            _receive(process, conn)
        start = time.time() + START_MARGIN_S
        for _, conn in clients:
            conn.send(start)
        outcomes: list[Outcome] = []
        pending = list(clients)
        reported = 0
        while any(process in awaited for process, _ in pending):
            await asyncio.sleep(0.1)
            if on_progress is not None and done.value > reported:
                on_progress(done.value - reported)
                reported = done.value
            for process, conn in list(pending):
                if conn.poll():
                    result = _receive(process, conn)
                    if isinstance(result, Exception):
                        raise result
                    if process in awaited:
                        outcomes += [Outcome(**o) for o in result]
                    pending.remove((process, conn))
                elif not process.is_alive():
                    raise RuntimeError(f"{process.name} exited with {process.exitcode}")
        if on_progress is not None and done.value > reported:
            on_progress(done.value - reported)
        return outcomes, start
    finally:
        for process, _ in clients:
            process.join(timeout=5 if process in awaited else 0)
            if process.is_alive():
                process.kill()
