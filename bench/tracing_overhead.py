#!/usr/bin/env python
"""Tracing overhead: the same load on the same cluster layout with tracing off, then on (spans
exported over OTLP/gRPC to a receiver in this process), side by side.

    python bench/tracing_overhead.py [--json PATH] [--requests N] [--seed S]

Beside the result: python_loop_ns, the calibration figure of bench/harness.py, from this run.
"""
from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from bench.harness import PRIORITIES, calibration_line, make_parser, progress, python_loop_ns, quantile, write_json  # noqa: E402
from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool  # noqa: E402
from services.common.ports import free_port  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402
from services.tools.client import RouterClient, chat_request, sampling_params  # noqa: E402

OTEL_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_INSECURE", "OTEL_BSP_SCHEDULE_DELAY")


class CountingReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans = 0

    def Export(self, request, context):
        self.spans += sum(len(s.spans) for rs in request.resource_spans for s in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


async def load(address: str, requests, bar):
    async with RouterClient(address) as client:
        async def one(priority, prompt, max_tokens):
            answer = await client.generate(chat_request(prompt, sampling_params(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True)), priority=priority)
            bar.update()
            return answer
        started = time.perf_counter()
        answers = await asyncio.gather(*(one(*r) for r in requests))
        return answers, time.perf_counter() - started


def run_once(requests, label: str) -> dict:
    config = single_pool(router=RouterConfig(port=0, http_port=0), scheduler=SchedulerConfig(port=0, max_step_tokens=128),
                         workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=128)])
    with LocalCluster(config, quiet=True) as cluster, progress(len(requests), label) as bar:
        answers, wall = asyncio.run(load(cluster.router_address, requests, bar))
    tokens = sum(len(a.token_ids) for a in answers)
    return {"tok_s": tokens / wall, "p99_ttft_ms": quantile([a.ttft_ms for a in answers], 0.99), "wall_s": wall}


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    requests = [(rng.choice(PRIORITIES), f"Describe the number {i}.", rng.randint(16, 48))
                for i in range(args.requests)]

    for var in OTEL_VARS:
        os.environ.pop(var, None)
    off = run_once(requests, "tracing off")

    receiver = CountingReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                       "OTEL_EXPORTER_OTLP_INSECURE": "true"})
    try:
        on = run_once(requests, "tracing on")
    finally:
        server.stop(0)

    loss = 1 - on["tok_s"] / off["tok_s"]
    loop_ns = python_loop_ns()     # with both clusters stopped
    print(f"\n{len(requests)} requests (seed {args.seed}), SmolLM2-135M, one CPU worker, this machine; "
          f"{receiver.spans} spans received with tracing on\n")
    print(f"{'':<18}{'tracing off':>12}{'tracing on':>12}{'change':>9}")
    print(f"{'output tokens/s':<18}{off['tok_s']:>12.1f}{on['tok_s']:>12.1f}{-loss:>+9.1%}")
    print(f"{'P99 TTFT ms':<18}{off['p99_ttft_ms']:>12.0f}{on['p99_ttft_ms']:>12.0f}"
          f"{on['p99_ttft_ms'] / off['p99_ttft_ms'] - 1:>+9.1%}")
    print(f"throughput loss {loss:.1%} (target <= 5%)")
    print(calibration_line(loop_ns))
    write_json(args.json, {
        "tok_s_tracing_off": off["tok_s"], "tok_s_tracing_on": on["tok_s"],
        "p99_ttft_ms_off": off["p99_ttft_ms"], "p99_ttft_ms_on": on["p99_ttft_ms"],
        "throughput_loss": loss, "spans_received": receiver.spans, "requests": len(requests),
        "python_loop_ns": loop_ns})


if __name__ == "__main__":
    main()
