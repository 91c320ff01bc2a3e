"""Load generation for the QoS benchmark (bench/qos_burst.py): each traffic class is sent by a
client process of its own.

Why separate processes: chat users and batch jobs are different clients. One asyncio client that
sends a 1,000-request burst spends its event loop on the flood's streams, and a High request's
measured TTFT then includes waiting for the benchmark's own client, not for the server (measured
at full scale of bench/qos_burst.py: up to ~450 ms between a High request's send time and the
router seeing it). Each process waits for one common start time and sends its jobs at their
offsets; times are measured inside the process that sent the request.

    from bench.loadgen import Job, run_clients
    outcomes, start = await run_clients(router_address, jobs, on_progress=bar.update)

The client processes are started with the "spawn" method and run `bench.loadgen._client_main`, so
this module must be imported as `bench.loadgen` with the repository root on sys.path (the bench
scripts put it there; spawn hands the parent's sys.path to its children).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

START_MARGIN_S = 0.2          # every client gets the start time this far ahead
# Client processes stand in for clients on other machines: at a lower CPU priority, they take the
# shared cores only when the services under test do not need them (without it, the flood's two
# client processes slowed the router's intake of a 1,000-request burst: High P99 TTFT 454 ms vs
# 241 ms in the same configuration).
CLIENT_NICE = 10


@dataclass(slots=True)
class Job:
    priority: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    at: float                     # seconds after the common start


@dataclass(slots=True)
class Outcome:
    priority: str
    ok: bool
    code: str = "OK"
    ttft_ms: float = 0.0          # measured by the client
    server_ttft_ms: float = 0.0   # measured by the scheduler (arrival there -> first token)
    e2e_ms: float = 0.0
    tokens: int = 0
    sent_at: float = 0.0          # seconds after the common start
    done_at: float = 0.0
    detail: str = ""              # the error message, for failures


async def _send(address: str, jobs: list[Job], start: float, done) -> list[Outcome]:
    import grpc

    from services.client import RouterClient, sampling_params
    from services.common.proto.qos.v1 import router_pb2

    async with RouterClient(address) as client:
        async def one(job: Job) -> Outcome:
            await asyncio.sleep(max(0.0, start + job.at - time.time()))
            sent_at = time.time() - start
            request = router_pb2.GenerateRequest(prompt=job.prompt, sampling=sampling_params(
                max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True))
            try:
                answer = await client.generate(request, priority=job.priority)
                outcome = Outcome(job.priority, True, ttft_ms=answer.ttft_ms, e2e_ms=answer.e2e_ms,
                                  server_ttft_ms=answer.server_timings.ttft_ms,
                                  tokens=len(answer.token_ids))
            except grpc.aio.AioRpcError as exc:
                outcome = Outcome(job.priority, False, code=exc.code().name, detail=exc.details() or "")
            outcome.sent_at, outcome.done_at = sent_at, time.time() - start
            with done.get_lock():
                done.value += 1
            return outcome

        return list(await asyncio.gather(*(one(job) for job in jobs)))


def _client_main(address: str, jobs: list[dict], done, conn) -> None:
    """One client process: say ready, wait for the start time, send, return the outcomes."""
    os.nice(CLIENT_NICE)
    try:
        conn.send("ready")
        start = conn.recv()
        outcomes = asyncio.run(_send(address, [Job(**job) for job in jobs], start, done))
        conn.send([asdict(o) for o in outcomes])
    except BaseException as exc:   # the parent must hear of it rather than wait forever
        conn.send(RuntimeError(f"client process failed: {exc!r}"))
        raise


async def run_clients(address: str, jobs: list[Job],
                      on_progress: Callable[[int], None] | None = None) -> tuple[list[Outcome], float]:
    """Send `jobs` through the router at `address`, one client process per priority. Returns the
    outcomes and the common start time (time.time())."""
    context = multiprocessing.get_context("spawn")   # no fork of a process holding gRPC channels
    done = context.Value("i", 0)
    clients = []
    for priority in sorted({job.priority for job in jobs}):
        ours, theirs = context.Pipe()
        group = [asdict(job) for job in jobs if job.priority == priority]
        process = context.Process(target=_client_main, args=(address, group, done, theirs),
                                  name=f"client-{priority}", daemon=True)
        process.start()
        clients.append((process, ours))
    try:
        for process, conn in clients:
            while not conn.poll():
                if not process.is_alive():
                    raise RuntimeError(f"{process.name} exited with {process.exitcode} before starting")
                await asyncio.sleep(0.05)
            conn.recv()
        start = time.time() + START_MARGIN_S
        for _, conn in clients:
            conn.send(start)
        outcomes: list[Outcome] = []
        pending = list(clients)
        reported = 0
        while pending:
            await asyncio.sleep(0.1)
            if on_progress is not None and done.value > reported:
                on_progress(done.value - reported)
                reported = done.value
            for process, conn in list(pending):
                if conn.poll():
                    result = conn.recv()
                    if isinstance(result, Exception):
                        raise result
                    outcomes += [Outcome(**o) for o in result]
                    pending.remove((process, conn))
                elif not process.is_alive():
                    raise RuntimeError(f"{process.name} exited with {process.exitcode}")
        if on_progress is not None and done.value > reported:
            on_progress(done.value - reported)
        return outcomes, start
    finally:
        for process, _ in clients:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
