#!/usr/bin/env python
"""How long a High call waits for grpc.aio to accept it during a flood: on the flood's port, and on a
port of its own (the router's High lane, services/router/high_lane.py).

Why: grpc.aio's server accepts calls one at a time, each acceptance a turn of the event loop. When
the handlers keep the loop busy, calls arrive faster than they are accepted and wait in gRPC core's
queue in arrival order, before any handler can read their class. This measures that wait alone,
without the router, scheduler or model: a server process (the Router service's protos, a handler
that spends --handler-us of CPU and holds the flood's streams open), a flood client process sending
--flood calls over one second (at nice 10, as bench/loadgen.py's), a High client process sending
--high calls spread over that second, and a process keeping one core busy (standing in for a
worker's engine; --no-burner: none). Each High call's wait is its send -> its handler's start
(CLOCK_MONOTONIC, one clock for every process on Linux). The two setups alternate run by run.

    python bench/grpc_accept.py [--runs 3] [--handler-us 500,1000] [--flood 800] [--json PATH]

Prints per handler cost and setup the median, P90 and max wait over all runs' High calls, with
python_loop_ns (calibration: the handlers' CPU is a pure-Python spin of fixed length, but the
server's own per-call cost is not). Linux only.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import calibration_line, machine, make_parser, python_loop_ns, quantile, write_json  # noqa: E402

SETUPS = ("one port", "High lane")
HOLD_S = 3.0            # the flood's streams stay open this long after their first chunk
START_IN_S = 1.0        # every client's common start, this long after they are launched


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def serve(ports: list[int], handler_s: float, queue, stop) -> None:
    """The server process: the Router service on ports[0], and on ports[1] too (the lane) when given."""
    import grpc

    from services.common.proto.qos.v1 import common_pb2, router_pb2_grpc

    async def main():
        started: dict[str, float] = {}

        class Router(router_pb2_grpc.RouterServicer):
            async def Generate(self, request, context):
                high = dict(context.invocation_metadata()).get("x-high")
                if high is not None:
                    started[high] = time.perf_counter()
                spin(handler_s)             # what a router's request path costs the loop
                yield common_pb2.GenerateChunk(token_ids=[1])
                if high is None:
                    await asyncio.sleep(HOLD_S)
                yield common_pb2.GenerateChunk(token_ids=[2], finish_reason=common_pb2.FINISH_REASON_LENGTH)

        servers = []
        for port in ports:
            server = grpc.aio.server()
            router_pb2_grpc.add_RouterServicer_to_server(Router(), server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            servers.append(server)
        queue.put("ready")
        while not stop.is_set():
            await asyncio.sleep(0.05)
        queue.put(started)
        for server in servers:
            await server.stop(0)

    asyncio.run(main())


def send(port: int, start: float, offsets: list[float], high: bool, queue) -> None:
    """A client process: one channel, a call at each offset after `start`; High ones record their send."""
    import grpc

    from services.common.proto.qos.v1 import router_pb2, router_pb2_grpc
    if not high:
        os.nice(10)

    async def main():
        sent: dict[str, float] = {}
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await channel.channel_ready()
            stub = router_pb2_grpc.RouterStub(channel)

            async def one(i: int, at: float):
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                metadata = (("x-high", str(i)),) if high else ()
                sent[str(i)] = time.perf_counter()
                async for _ in stub.Generate(router_pb2.GenerateRequest(prompt="x"), metadata=metadata):
                    pass

            await asyncio.gather(*(one(i, at) for i, at in enumerate(offsets)))
        queue.put(sent)

    asyncio.run(main())


def burn(until: float) -> None:
    spin(until - time.perf_counter())


def one_run(setup: str, handler_s: float, flood: int, high: int, burner: bool) -> list[float]:
    """The High calls' waits (ms) in one run of `setup`."""
    from services.common.ports import free_port
    context = multiprocessing.get_context("spawn")
    ports = [free_port("127.0.0.1")]
    if setup == "High lane":
        while (port := free_port("127.0.0.1")) == ports[0]:
            pass
        ports.append(port)
    server_queue, flood_queue, high_queue, stop = context.Queue(), context.Queue(), context.Queue(), context.Event()
    server = context.Process(target=serve, args=(ports, handler_s, server_queue, stop), daemon=True)
    server.start()
    server_queue.get(timeout=60)
    start = time.perf_counter() + START_IN_S
    clients = [context.Process(target=send, args=(ports[0], start, [i / flood for i in range(flood)], False,
                                                  flood_queue), daemon=True),
               context.Process(target=send, args=(ports[-1], start, [0.05 + i * 0.9 / high for i in range(high)],
                                                  True, high_queue), daemon=True)]
    if burner:
        clients.append(context.Process(target=burn, args=(start + 2.0,), daemon=True))
    for process in clients:
        process.start()
    sent = high_queue.get(timeout=120)
    flood_queue.get(timeout=120)
    stop.set()
    started = server_queue.get(timeout=30)
    for process in [*clients, server]:
        process.join(timeout=10)
    return [(started[key] - sent[key]) * 1000 for key in sent]


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--runs", type=int, default=3, help="runs of each setup per handler cost (alternating)")
    parser.add_argument("--handler-us", default="500,1000", help="handler CPU per call, us (comma-separated)")
    parser.add_argument("--flood", type=int, default=800, help="flood calls, sent over one second")
    parser.add_argument("--high", type=int, default=14, help="High calls, spread over the flood's second")
    parser.add_argument("--no-burner", action="store_true", help="no process keeping a core busy")
    args = parser.parse_args()
    loop_ns = python_loop_ns()
    results = []
    for handler_us in [int(v) for v in args.handler_us.split(",")]:
        waits: dict[str, list[float]] = {setup: [] for setup in SETUPS}
        for run in range(args.runs):
            for setup in SETUPS:
                waits[setup] += one_run(setup, handler_us / 1e6, args.flood, args.high, not args.no_burner)
                print(f"handler {handler_us} us, {setup}, run {run + 1}: max wait so far "
                      f"{max(waits[setup]):.1f} ms", file=sys.stderr, flush=True)
        for setup in SETUPS:
            w = waits[setup]
            results.append({"handler_us": handler_us, "setup": setup, "calls": len(w),
                            "median_ms": statistics.median(w), "p90_ms": quantile(w, 0.9), "max_ms": max(w)})
    print(f"\n{machine(cpu=False)}; {args.flood} flood calls in 1 s, {args.high} High calls, {args.runs} run(s) each; "
          f"{'no burner' if args.no_burner else 'one core kept busy by another process'}")
    print("| handler CPU a call | High sent to | calls | send -> handler: median | P90 | max |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['handler_us']} us | {r['setup']} | {r['calls']} | {r['median_ms']:.1f} ms | "
              f"{r['p90_ms']:.1f} ms | {r['max_ms']:.1f} ms |")
    print(calibration_line(loop_ns))
    write_json(args.json, {"machine": machine(cpu=False), "python_loop_ns": loop_ns, "flood": args.flood,
                           "burner": not args.no_burner, "results": results})


if __name__ == "__main__":
    main()
