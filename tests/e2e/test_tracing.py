"""One trace per request across router -> scheduler -> worker, received by a real OTLP receiver;
over HTTP, the caller's own trace (W3C traceparent) is continued."""
from __future__ import annotations

import http.client
import json
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.common.ports import free_port
from services.local.cluster import LocalCluster
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import cluster_config, run

pytestmark = pytest.mark.slow

CALLER_TRACE, CALLER_SPAN = bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736"), bytes.fromhex("00f067aa0ba902b7")
CALLER_TRACEPARENT = f"00-{CALLER_TRACE.hex()}-{CALLER_SPAN.hex()}-01"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An in-process OTLP/gRPC trace receiver that keeps every span with its service name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append((attrs.get("service.name"), span))
        return trace_service_pb2.ExportTraceServiceResponse()


def start_receiver() -> tuple[Receiver, grpc.Server, str]:
    """A Receiver serving on a free loopback port: (it, its server, its OTLP endpoint)."""
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    collector = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return collector, server, f"http://127.0.0.1:{port}"


@pytest.fixture
def receiver(monkeypatch):
    collector, server, endpoint = start_receiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    yield collector
    server.stop(0)


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value or v.int_value or v.double_value or v.bool_value
    return out


def test_one_trace_across_three_services(receiver):
    with LocalCluster(cluster_config(), quiet=True) as cluster:
        async def ask():
            async with RouterClient(cluster.router_address) as client:
                return await client.generate(chat_request("Hello!", sampling_params(max_tokens=5)),
                                             priority="high", tenant="acme")
        answer = run(ask())
        # Over HTTP, the caller's trace context is continued: our spans join its trace.
        router = cluster.config.router
        conn = http.client.HTTPConnection(router.host, router.http_port, timeout=60)
        conn.request("POST", "/v1/completions", headers={"content-type": "application/json",
                                                        "traceparent": CALLER_TRACEPARENT},
                     body=json.dumps({"model": Path(cluster.config.model).name, "prompt": "Hi",
                                      "max_tokens": 3}))
        assert conn.getresponse().status == 200
        conn.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            names = {(service, span.name, span.trace_id) for service, span in receiver.spans}
            if {("qos-router", "router.generate", CALLER_TRACE), ("qos-scheduler", "scheduler.decode", CALLER_TRACE),
                    ("qos-worker", "worker.step", CALLER_TRACE)} <= names:
                break
            time.sleep(0.2)

    continued = [(s, sp) for s, sp in receiver.spans if sp.trace_id == CALLER_TRACE]
    assert {s for s, _ in continued} == {"qos-router", "qos-scheduler", "qos-worker"}
    assert next(sp for _, sp in continued if sp.name == "router.generate").parent_span_id == CALLER_SPAN

    spans = {span.name: (service, span) for service, span in receiver.spans if span.trace_id != CALLER_TRACE}
    router_span = spans["router.generate"][1]
    trace_id = router_span.trace_id
    mine = [(s, sp) for s, sp in receiver.spans if sp.trace_id == trace_id]
    assert {s for s, _ in mine} == {"qos-router", "qos-scheduler", "qos-worker"}

    by_name = {sp.name: sp for _, sp in mine}
    submit = by_name["scheduler.submit"]
    assert by_name["router.route"].parent_span_id == router_span.span_id
    assert submit.parent_span_id == router_span.span_id
    for phase in ("scheduler.queue", "scheduler.prefill", "scheduler.decode"):
        assert by_name[phase].parent_span_id == submit.span_id
    steps = [sp for _, sp in mine if sp.name == "worker.step"]
    assert steps and all(sp.parent_span_id == submit.span_id for sp in steps)
    assert all(any(link.span_id == submit.span_id for link in sp.links) for sp in steps)

    a = attrs(router_span)
    assert (a["qos.priority"], a["qos.tenant"], a["qos.pool"]) == ("high", "acme", "cpu")
    assert a["qos.output_tokens"] == len(answer.token_ids) and a["qos.prompt_tokens"] > 0
    assert attrs(by_name["router.route"])["qos.route.rule"] == "high-to-primary"
    s = attrs(submit)
    assert s["qos.priority"] == "high" and s["qos.outcome"] == "completed" and "qos.preempted" in s
