#!/usr/bin/env python
"""CPU the control plane spends on each request and on each streamed chunk: the router's and the
scheduler's process CPU time (user + system, from /proc) over batches of concurrent requests,
beside a bare gRPC relay measured in the same run.

Why: at the QoS benchmark's full scale (800 requests in 1 s on 2 cores) High's time to first
token is spent outside the scheduler, waiting on the router's event loop while it takes the flood
in. How much of the router's CPU is gRPC's own (each call and each message costs the same
whatever the service does with it) and how much is ours decides what can make it cheaper.

The cluster: router, scheduler and one worker (the random-weight bench model, 1 thread) as in
`qos-serve demo`, measured twice in the run: with the router's requests to the scheduler on the
pool's link (one SubmitLink stream for all, the default) and with a Submit call each
(`router.scheduler_link = "calls"`, how it was until 2026-12-02). Each batch is --requests
concurrent Medium requests with a 200-character prompt and T output tokens, streamed one token a
chunk (x-stream-interval: 1); T = 1 gives the cost of a request with one chunk, T = 1 + --chunks
the cost of --chunks more chunks.

The baseline: the same Router.Generate -> Scheduler.Submit relay with nothing else in it, as
two processes of this script (a "scheduler" that answers every call with K chunks, one every
--chunk-gap-ms, and a "router" whose handler only forwards the call and relays the chunks), the
same protos, messages and server options, driven the same way.

    python bench/control_plane_cpu.py [--requests 200] [--chunks 16] [--rounds 3] [--json PATH]

Prints, per process, ms of CPU per request and per chunk for both clusters and the bare relay and
their ratios, with python_loop_ns (calibration). Linux only (/proc).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.harness import calibration_line, machine, make_parser, model_or_bench, python_loop_ns, write_json  # noqa: E402
from services.common.config import SCHEDULER_LINKS  # noqa: E402
from services.common.grpc_server import CHANNEL_OPTIONS, SERVER_OPTIONS  # noqa: E402
from services.common.ports import free_port  # noqa: E402
from services.common.proto.qos.v1 import common_pb2, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402

PROMPT = ("The quick brown fox jumps over the lazy dog. " * 5)[:200]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc/PID/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Costs:
    """ms of CPU a request and a chunk cost one process, from two batches of `requests`: one
    chunk a request, and 1 + `chunks` a request."""
    per_request_ms: float
    per_chunk_ms: float

    @classmethod
    def fit(cls, one_chunk_s: float, many_chunks_s: float, requests: int, chunks: int) -> "Costs":
        per_chunk = max(0.0, many_chunks_s - one_chunk_s) / (requests * chunks)
        return cls(one_chunk_s / requests * 1000, per_chunk * 1000)


# --- the bare relay --------------------------------------------------------------------------

def _serve(port: int, service: str, method: str, handler, deserializer) -> None:
    async def main() -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        handlers = {method: grpc.unary_stream_rpc_method_handler(
            handler, request_deserializer=deserializer,
            response_serializer=common_pb2.GenerateChunk.SerializeToString)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()
    asyncio.run(main())


def bare_scheduler(port: int, gap_s: float) -> None:
    """Answers Submit with `max_tokens` chunks shaped like the scheduler's, one every `gap_s`."""
    async def submit(request: scheduler_pb2.SubmitRequest, context):
        count = request.sampling.max_tokens
        for i in range(count):
            if i:
                await asyncio.sleep(gap_s)
            last = i == count - 1
            yield common_pb2.GenerateChunk(
                request_id=request.request_id, token_ids=[1000 + i], text=" word",
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                usage=common_pb2.Usage(prompt_tokens=40, completion_tokens=i + 1) if last else None)
    _serve(port, "qos.v1.Scheduler", "Submit", submit, scheduler_pb2.SubmitRequest.FromString)


def bare_router(port: int, scheduler_port: int) -> None:
    """Forwards Generate to the bare scheduler as a Submit and relays its chunks: nothing else."""
    stub = None

    async def generate(raw: router_pb2.GenerateRequestBytes, context):
        nonlocal stub
        if stub is None:
            stub = scheduler_pb2_grpc.SchedulerStub(
                grpc.aio.insecure_channel(f"127.0.0.1:{scheduler_port}", options=CHANNEL_OPTIONS))
        submit = scheduler_pb2.SubmitRequest(request_id="r", prompt=raw.prompt.decode(), sampling=raw.sampling)
        async for chunk in stub.Submit(submit):
            yield chunk
    _serve(port, "qos.v1.Router", "Generate", generate, router_pb2.GenerateRequestBytes.FromString)


# --- driving either ----------------------------------------------------------------------------

async def send_batch(address: str, requests: int, tokens: int) -> None:
    """`requests` concurrent Medium requests of `tokens` output tokens, one token a chunk."""
    metadata = (("x-priority", "medium"), ("x-stream-interval", "1"))
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def one() -> None:
            request = router_pb2.GenerateRequest(prompt=PROMPT, sampling=common_pb2.SamplingParams(
                max_tokens=tokens, temperature=0.0, ignore_eos=True))
            got = 0
            async for chunk in stub.Generate(request, metadata=metadata):
                got += len(chunk.token_ids)
            if got != tokens:
                raise RuntimeError(f"asked for {tokens} tokens, got {got}")
        await asyncio.gather(*(one() for _ in range(requests)))


def measure(address: str, pids: dict[str, int], requests: int, chunks: int, rounds: int) -> dict[str, Costs]:
    """Each process's Costs: the median over `rounds` of batches with 1 and 1 + `chunks` tokens."""
    asyncio.run(send_batch(address, min(requests, 20), 2))      # connections up, code paths warm
    spent: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for tokens in (1, 1 + chunks):
            before = {name: process_cpu_s(pid) for name, pid in pids.items()}
            asyncio.run(send_batch(address, requests, tokens))
            for name, pid in pids.items():
                spent.setdefault((name, tokens), []).append(process_cpu_s(pid) - before[name])
    return {name: Costs.fit(statistics.median(spent[name, 1]), statistics.median(spent[name, 1 + chunks]),
                            requests, chunks) for name in pids}


def measure_bare(requests: int, chunks: int, rounds: int, gap_s: float) -> dict[str, Costs]:
    context = multiprocessing.get_context("spawn")
    scheduler_port, router_port = free_port(), free_port()
    processes = {"scheduler": context.Process(target=bare_scheduler, args=(scheduler_port, gap_s), daemon=True),
                 "router": context.Process(target=bare_router, args=(router_port, scheduler_port), daemon=True)}
    for process in processes.values():
        process.start()
    try:
        asyncio.run(_wait_for(f"127.0.0.1:{router_port}"))
        return measure(f"127.0.0.1:{router_port}", {n: p.pid for n, p in processes.items()},
                       requests, chunks, rounds)
    finally:
        for process in processes.values():
            process.terminate()
            process.join(5)


async def _wait_for(address: str, timeout_s: float = 30.0) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)


def measure_cluster(model: str, requests: int, chunks: int, rounds: int,
                    scheduler_link: str = "stream") -> dict[str, Costs]:
    from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool
    config = single_pool(router=RouterConfig(port=0, http_port=-1, scheduler_link=scheduler_link),
                         scheduler=SchedulerConfig(port=0),
                         workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=256)], model=model)
    with LocalCluster(config, quiet=True) as cluster:
        pids = {"router": cluster.processes["router"].pid,
                "scheduler": cluster.processes[f"{config.pools[0].name}/scheduler"].pid}
        return measure(cluster.router_address, pids, requests, chunks, rounds)


def table(link: dict[str, Costs], calls: dict[str, Costs], bare: dict[str, Costs]) -> str:
    lines = ["| process | figure | cluster, link | cluster, a call each | link / calls | bare gRPC relay | "
             "link / bare |", "|---|---|---|---|---|---|---|"]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b > 0 else "-"
    for name in ("router", "scheduler"):
        for label, attr in (("ms CPU per request", "per_request_ms"), ("ms CPU per chunk", "per_chunk_ms")):
            ours, old, base = (getattr(c[name], attr) for c in (link, calls, bare))
            lines.append(f"| {name} | {label} | {ours:.3f} | {old:.3f} | {ratio(ours, old)} | {base:.3f} | "
                         f"{ratio(ours, base)} |")
    return "\n".join(lines)


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--requests", type=int, default=200, help="concurrent requests a batch")
    parser.add_argument("--chunks", type=int, default=16, help="extra chunks a request in the second batch")
    parser.add_argument("--rounds", type=int, default=3, help="batches of each kind (median)")
    parser.add_argument("--chunk-gap-ms", type=float, default=5.0,
                        help="the bare scheduler's time between a stream's chunks (a step)")
    parser.add_argument("--model", default=None, help="model folder or 'default' (default: the bench model)")
    args = parser.parse_args()
    if not Path("/proc/self/stat").exists():
        sys.exit("bench/control_plane_cpu.py reads process CPU times from /proc: Linux only")
    loop_ns = python_loop_ns()
    print(machine(cpu=False))
    print(calibration_line(loop_ns), flush=True)
    print(f"bare gRPC relay: {args.requests} concurrent requests, 1 and {1 + args.chunks} chunks, "
          f"{args.rounds} rounds ...", flush=True)
    bare = measure_bare(args.requests, args.chunks, args.rounds, args.chunk_gap_ms / 1000)
    clusters = {}
    for link in SCHEDULER_LINKS:
        print(f"cluster (router, scheduler, one worker on the bench model), router.scheduler_link = {link} ...",
              flush=True)
        clusters[link] = measure_cluster(model_or_bench(args.model), args.requests, args.chunks, args.rounds, link)
    print(table(clusters["stream"], clusters["calls"], bare))
    write_json(args.json, {
        "python_loop_ns": loop_ns, "requests": args.requests, "chunks": args.chunks, "rounds": args.rounds,
        **{f"{side}_{name}_{attr}": getattr(costs[name], attr)
           for side, costs in (("cluster", clusters["stream"]), ("cluster_calls", clusters["calls"]), ("bare", bare))
           for name in costs for attr in ("per_request_ms", "per_chunk_ms")}})


if __name__ == "__main__":
    main()
