"""The router's admin endpoints need the admin key in every mode, auth off included (where a
tenant is whatever x-tenant says): adapters, the console's cluster view, reading or cancelling
a request by id. Anonymous /metrics, /v1/alerts and /v1/models name no tenant. A real cluster,
auth off, over HTTP; the same with auth on is in test_tenants.py and test_console.py."""
from __future__ import annotations

import http.client
import json

import pytest

from services.common.config import SlaConfig
from services.local.cluster import LocalCluster
from tests.e2e.conftest import bench_model, cluster_config

ADMIN = "an-admin-key-for-tests"
SECRET_TENANT = "tenant-with-a-private-objective"


def request(cluster, method: str, path: str, key: str | None = None, body: dict | None = None,
            headers: dict | None = None, read_all: bool = True):
    router = cluster.config.router
    conn = http.client.HTTPConnection(router.host, router.http_port, timeout=60)
    try:
        auth = {"authorization": f"Bearer {key}"} if key else {}
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"content-type": "application/json", **auth, **(headers or {})})
        response = conn.getresponse()
        if not read_all:                     # an endless stream: its status and first line
            return response.status, response.readline().decode()
        data = response.read().decode()
        return response.status, (json.loads(data) if response.getheader("content-type", "").startswith(
            "application/json") else data)
    finally:
        conn.close()


def raw_request(cluster, path: str, key: str, body: bytes) -> tuple[int, dict]:
    router = cluster.config.router
    conn = http.client.HTTPConnection(router.host, router.http_port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json",
                                                       "authorization": f"Bearer {key}"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def make_cluster(admin_key: str):
    config = cluster_config(model=bench_model(), dtype="fp32")
    config.auth.admin_key = admin_key
    config.sla = [SlaConfig(priority="high", ttft_p99_ms=500.0),
                  SlaConfig(priority="low", tenant=SECRET_TENANT, ttft_p99_ms=900.0)]
    return LocalCluster(config, quiet=True)


@pytest.fixture(scope="module")
def cluster():
    with make_cluster(ADMIN) as running:
        yield running


NOT_ADMIN = [(None, {}), ("EMPTY", {"x-tenant": SECRET_TENANT}), ("a-guessed-key", {})]


@pytest.mark.parametrize("key,headers", NOT_ADMIN)
def test_auth_off_the_admin_endpoints_still_need_the_admin_key(cluster, key, headers):
    for method, path, body in (("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}),
                               ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
                               ("GET", "/console/events", None),
                               ("GET", "/v1/requests/chatcmpl-someone-elses", None),
                               ("POST", "/v1/requests/chatcmpl-someone-elses/cancel", {})):
        status, answer = request(cluster, method, path, key, body, headers)
        assert status == 403, (method, path, status, answer)
        assert answer["error"]["param"] == "authorization" and "admin key" in answer["error"]["message"]


def test_x_tenant_cannot_name_the_admin_keys_tenant(cluster):
    """'admin' is the tenant the admin key's requests are billed and scoped under."""
    for method, path, body in (("GET", "/console/events", None), ("GET", "/v1/usage", None),
                               ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})):
        status, answer = request(cluster, method, path, None, body, {"x-tenant": "admin"})
        assert status == 400 and answer["error"]["param"] == "x-tenant", (path, answer)
        assert "reserved" in answer["error"]["message"]


def test_with_the_admin_key_they_answer(cluster):
    status, answer = request(cluster, "POST", "/v1/load_lora_adapter", ADMIN, {"lora_name": "x"})
    assert status == 400 and answer["error"]["param"] == "lora_path"        # past the gate: the body's turn
    for raw in (b"\xff\xfe", b"[" * 100_000, b"[1]"):       # not UTF-8, nested past any parser, not an object
        status, answer = raw_request(cluster, "/v1/load_lora_adapter", ADMIN, raw)
        assert status == 400 and answer["error"]["param"] == "body", (raw[:8], answer)
    status, first = request(cluster, "GET", "/console/events", ADMIN, read_all=False)
    assert status == 200 and first.startswith("data: ")
    status, answer = request(cluster, "POST", "/v1/requests/chatcmpl-nobody/cancel", ADMIN, {})
    assert status == 404


def test_anonymous_metrics_alerts_and_models_name_no_tenant(cluster):
    status, text = request(cluster, "GET", "/metrics")
    assert status == 200 and "qos_sla_" in text and SECRET_TENANT not in text
    status, text = request(cluster, "GET", "/metrics", ADMIN)
    assert status == 200 and f'tenant="{SECRET_TENANT}"' in text       # the admin sees them all
    for headers in ({}, {"x-tenant": SECRET_TENANT}):
        status, alerts = request(cluster, "GET", "/v1/alerts", headers=headers)
        assert status == 200 and SECRET_TENANT not in json.dumps(alerts)
        assert [o["priority"] for o in alerts["objectives"]] == ["high"]
    status, alerts = request(cluster, "GET", "/v1/alerts", ADMIN)
    assert SECRET_TENANT in json.dumps(alerts)
    status, models = request(cluster, "GET", "/v1/models")
    assert status == 200 and models["data"] and SECRET_TENANT not in json.dumps(models)


def test_with_no_admin_key_configured_the_refusal_says_how_to_set_one():
    with make_cluster("") as bare:
        status, answer = request(bare, "POST", "/v1/load_lora_adapter", "EMPTY", {"lora_name": "x", "lora_path": "/"})
        assert status == 403 and "none is configured: set [auth] admin_key or $QOS_ADMIN_KEY" in answer["error"]["message"]
