#!/usr/bin/env python
"""What the router adds to an idle High request's first token: the same requests, one at a time
on an idle cluster, through the router (client -> router -> scheduler) and straight to the
scheduler's Submit (client -> scheduler, with the router's cluster credential), in alternating
rounds on one cluster; beside them a bare gRPC server-streaming call (a servicer that answers at
once, in its own process) as the floor of one hop on this host.

Per path, the P50 of: the client's TTFT, the scheduler's own arrival -> first token (server
timings), and the rest (hops, the router, the client). The difference of the two paths' TTFT is
the router's part: its hop, its own work and its stream back.

    python bench/router_hop.py [--json PATH] [--requests N] [--rounds R] [--max-tokens T]
"""
from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import machine, make_parser, progress, write_json  # noqa: E402

PROMPT = "Summarise the following note for a colleague: the quarterly numbers came in higher than expected, " * 2
GAP_S = 0.15          # between requests: each is alone in the cluster


def _bare_server(port: int) -> None:
    import grpc

    from services.common.proto.qos.v1 import common_pb2, router_pb2_grpc

    class Answer(router_pb2_grpc.RouterServicer):
        async def Generate(self, request, context):
            yield common_pb2.GenerateChunk(text="x", token_ids=[1], finish_reason=common_pb2.FINISH_REASON_LENGTH)

    async def main():
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(Answer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()
    asyncio.run(main())


async def bare_hop_ms(requests: int) -> float:
    """P50 of a bare server-streaming call's first message, client and server in two processes."""
    import grpc

    from services.common.ports import free_port
    from services.common.proto.qos.v1 import router_pb2, router_pb2_grpc
    port = free_port("127.0.0.1")
    server = multiprocessing.Process(target=_bare_server, args=(port,), daemon=True)
    server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            stub, times = router_pb2_grpc.RouterStub(channel), []
            for i in range(requests + 10):
                started = time.perf_counter()
                async for _ in stub.Generate(router_pb2.GenerateRequest(prompt="hi")):
                    if i >= 10:
                        times.append((time.perf_counter() - started) * 1000)
                await asyncio.sleep(0.02)
        return statistics.median(times)
    finally:
        server.terminate()


async def via_router(cluster, requests: int, max_tokens: int, bar) -> list[tuple[float, float]]:
    from services.common.proto.qos.v1 import router_pb2
    from services.tools.client import RouterClient, sampling_params
    rows = []
    async with RouterClient(cluster.router_address) as client:
        for _ in range(requests):
            answer = await client.generate(router_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling_params(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True)), priority="high")
            rows.append((answer.ttft_ms, answer.server_timings.ttft_ms))
            bar.update(1)
            await asyncio.sleep(GAP_S)
    return rows


async def direct(cluster, requests: int, max_tokens: int, bar) -> list[tuple[float, float]]:
    from services.common.cluster_auth import ClusterTrust
    from services.common.proto.qos.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
    from services.tools.client import sampling_params
    trust = ClusterTrust.load(cluster.config.security, "router")
    rows = []
    async with trust.channel(cluster.config.pools[0].scheduler.address, "scheduler") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for _ in range(requests):
            submit = scheduler_pb2.SubmitRequest(
                request_id=uuid.uuid4().hex, priority=common_pb2.PRIORITY_HIGH, tenant="bench", cache_scope="bench",
                prompt=PROMPT, sampling=sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            started, first, server_ttft = time.perf_counter(), None, 0.0
            async for chunk in stub.Submit(submit, metadata=trust.metadata):
                if first is None:
                    first = (time.perf_counter() - started) * 1000
                if chunk.finish_reason:
                    server_ttft = chunk.timings.ttft_ms
            rows.append((first, server_ttft))
            bar.update(1)
            await asyncio.sleep(GAP_S)
    return rows


def summary(rows: list[tuple[float, float]]) -> dict:
    return {"ttft_p50_ms": statistics.median(r[0] for r in rows),
            "scheduler_ttft_p50_ms": statistics.median(r[1] for r in rows),
            "rest_p50_ms": statistics.median(r[0] - r[1] for r in rows), "requests": len(rows)}


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--requests", type=int, default=40, help="requests per path and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the two paths alternating in each")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens a request asks for")
    args = parser.parse_args(argv)
    from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool
    from services.engine.bench_model import bench_model_dir
    from services.local.cluster import LocalCluster

    config = single_pool(model=str(bench_model_dir()), router=RouterConfig(port=0, http_port=0),
                         scheduler=SchedulerConfig(port=0), workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=256)])
    rows: dict[str, list] = {"router": [], "direct": []}
    with LocalCluster(config, quiet=True) as cluster:
        asyncio.run(via_router(cluster, 5, args.max_tokens, progress(5, "warm-up")))
        with progress(2 * args.rounds * args.requests, "idle High requests") as bar:
            for r in range(args.rounds):
                order = ("router", "direct") if r % 2 == 0 else ("direct", "router")
                for path in order:
                    run = via_router if path == "router" else direct
                    rows[path] += asyncio.run(run(cluster, args.requests, args.max_tokens, bar))
    result = {path: summary(rows[path]) for path in rows}
    result["router_adds_ms"] = result["router"]["ttft_p50_ms"] - result["direct"]["ttft_p50_ms"]
    result["bare_grpc_hop_p50_ms"] = asyncio.run(bare_hop_ms(args.requests * 2))
    result.update(machine=machine(), max_tokens=args.max_tokens, rounds=args.rounds)
    for path in ("router", "direct"):
        s = result[path]
        print(f"{path:>6}: TTFT P50 {s['ttft_p50_ms']:.2f} ms = scheduler {s['scheduler_ttft_p50_ms']:.2f} "
              f"+ rest {s['rest_p50_ms']:.2f}")
    print(f"the router adds {result['router_adds_ms']:.2f} ms; a bare gRPC call's first message: "
          f"{result['bare_grpc_hop_p50_ms']:.2f} ms")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
