"""SLA alerts on a real cluster: High requests slower than the contract open exactly one alert,
posted to a webhook receiver (a local HTTP server), listed by Router.Alerts, `/v1/alerts`,
`qos-serve alerts` and exported to Prometheus; fast requests afterwards resolve it once."""
from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import grpc
import pytest

from services.common.config import AlertsConfig, SlaConfig
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.proto.qos.v1 import router_pb2, router_pb2_grpc
from services.local.cluster import LocalCluster
from services.tools.client import chat_request, sampling_params
from tests.e2e.conftest import bench_model, cluster_config, run

pytestmark = pytest.mark.slow

OBJECTIVE_MS = 300.0
SLOW_TOKENS = 1024


class Receiver(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):          # noqa: N802
        type(self).received.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def receiver():
    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/alerts"
    server.shutdown()


@pytest.fixture(scope="module")
def cluster(receiver):
    config = cluster_config(model=bench_model())
    # High end to end within OBJECTIVE_MS: SLOW_TOKENS take longer than that on any CPU (the bench
    # model's step is ~1-3 ms here, and it moves with the host and the sampler: 128 tokens ran in
    # well under a second once sampling got cheaper), 1 token far less.
    config.sla = [SlaConfig(priority="high", e2e_p99_ms=OBJECTIVE_MS, window_s=4.0, for_seconds=1.0,
                            resolve_seconds=1.0, min_requests=2)]
    config.alerts = AlertsConfig(webhooks=[receiver], evaluate_every_s=0.2)
    with LocalCluster(config, quiet=True) as running:
        yield running


async def high_requests(cluster, max_tokens: int, until, timeout_s: float = 60, concurrency: int = 3) -> int:
    """Keep `concurrency` High requests going until `until()` holds (or the timeout); returns how
    many completed."""
    done = 0
    deadline = time.monotonic() + timeout_s

    async def one_after_another(stub):
        nonlocal done
        while time.monotonic() < deadline and not until():
            request = chat_request("Count to fifty.", sampling_params(max_tokens=max_tokens, ignore_eos=True))
            async for chunk in stub.Generate(request, metadata=[("x-priority", "high")]):
                if chunk.finish_reason:
                    done += 1

    async with grpc.aio.insecure_channel(cluster.router_address, options=CHANNEL_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await asyncio.gather(*(one_after_another(stub) for _ in range(concurrency)))
    return done


async def alerts(cluster) -> router_pb2.AlertsReply:
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        return await router_pb2_grpc.RouterStub(channel).Alerts(router_pb2.AlertsRequest())


def http_get(cluster, path: str) -> str:
    conn = http.client.HTTPConnection(cluster.config.router.host, cluster.config.router.http_port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def wait_for(predicate, timeout_s: float):
    """The predicate's value once it is true, else its last value after the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.2)
    return predicate()


def test_a_breach_fires_once_and_recovery_resolves_once(cluster):
    Receiver.received = []
    firing = lambda: [p for p in Receiver.received if p["status"] == "firing"]      # noqa: E731
    resolved = lambda: [p for p in Receiver.received if p["status"] == "resolved"]  # noqa: E731

    async def while_slow():
        """Slow High requests until the alert fires; look at it while they go on."""
        stop = False
        load = asyncio.create_task(high_requests(cluster, max_tokens=SLOW_TOKENS, until=lambda: stop))
        while not firing() and not load.done():
            await asyncio.sleep(0.2)
        reply = await alerts(cluster)
        metrics = await asyncio.to_thread(http_get, cluster, "/metrics")
        stop = True
        return await load, reply, metrics

    completed, reply, metrics = run(while_slow())
    assert completed >= 2 and len(firing()) == 1
    (alert,) = firing()[0]["alerts"]
    assert alert["labels"] == {"alertname": "QosSlaBreached", "priority": "high", "tenant": "*",
                               "objective": "e2e_p99_ms", "severity": "page"}
    assert float(alert["annotations"]["observed"]) > OBJECTIVE_MS and alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert [(a.state, a.objective) for a in reply.alerts] == [("firing", "e2e_p99_ms")]
    assert reply.objectives[0].state == "firing" and reply.objectives[0].has_verdict
    assert 'qos_sla_breached{objective="e2e_p99_ms",priority="high",tenant="*"} 1.0' in metrics
    assert f'qos_sla_objective{{objective="e2e_p99_ms",priority="high",tenant="*"}} {OBJECTIVE_MS}' in metrics

    # Fast requests: once the slow ones leave the 4 s window, 1 s under the objective resolves it.
    run(high_requests(cluster, max_tokens=1, until=resolved))
    assert len(wait_for(resolved, 5)) == 1 and len(Receiver.received) == 2
    assert resolved()[0]["alerts"][0]["fingerprint"] == alert["fingerprint"]
    assert resolved()[0]["alerts"][0]["endsAt"] != "0001-01-01T00:00:00Z"
    reply = run(alerts(cluster))
    # Resolved, and not firing again. "pending" is allowed: any High request that ends over the
    # objective after the resolution (a fresh-clone CI run on this loaded 2-core machine saw the state
    # pending here once) opens a new breach, which must hold for_seconds before it could fire.
    assert [a.state for a in reply.alerts] == ["resolved"] and reply.objectives[0].state in ("ok", "pending")
    body = json.loads(http_get(cluster, "/v1/alerts"))
    assert body["alerts"][0]["state"] == "resolved" and body["objectives"][0]["priority"] == "high"
    shown = subprocess.run([sys.executable, "-m", "services.tools.cli", "alerts", "--router", cluster.router_address],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "RESOLVED" in shown.stdout and "end-to-end P99" in shown.stdout
