"""A real cluster whose PostgreSQL store sits behind a loopback proxy the test turns into a black
hole (tests/blackhole.py: nothing forwarded, nothing closed, the kernel still acknowledging), with
auth required. While the store is gone every request is answered without waiting on it; a tenant
without limits is served throughout, a tenant with limits is refused (503, Retry-After) once the
router's copy of the store is [store] stale_s old; the ledger's unwritten rows are counted on
/metrics; what reads the store itself (usage, kept responses) is a 503 with Retry-After, and a
response asked to be kept goes out unkept. Once the proxy forwards again, every answered request is billed exactly once, tenants'
totals equal their rows, and a key revoked during the outage stops working."""
from __future__ import annotations

import http.client
import json
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url

from services.local.cluster import LocalCluster
from services.store.store import Store, Tenant
from tests.blackhole import BlackHoleProxy
from tests.e2e.conftest import bench_model, cluster_config
from tests.postgres import binaries, postgres_server

pytestmark = pytest.mark.slow

STALE_S, REFRESH_S = 4.0, 1.0
OUTAGE_S = 10.0


def ask(cluster, key: str) -> tuple[int, dict, dict, float]:
    router = cluster.config.router
    conn = http.client.HTTPConnection(router.host, router.http_port, timeout=30)
    started = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", headers={"authorization": f"Bearer {key}",
                                                         "content-type": "application/json"},
                     body=json.dumps({"model": Path(cluster.config.model).name, "prompt": "Hello",
                                      "max_tokens": 3, "temperature": 0}))
        reply = conn.getresponse()
        return (reply.status, {k.lower(): v for k, v in reply.getheaders()}, json.loads(reply.read()),
                time.monotonic() - started)
    finally:
        conn.close()


def call(cluster, method: str, path: str, key: str, body: dict | None = None) -> tuple[int, dict, dict]:
    router = cluster.config.router
    conn = http.client.HTTPConnection(router.host, router.http_port, timeout=30)
    try:
        conn.request(method, path, headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
                     body=json.dumps(body) if body is not None else None)
        reply = conn.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, json.loads(reply.read())
    finally:
        conn.close()


def metrics(cluster) -> dict[str, float]:
    router = cluster.config.router
    text = urllib.request.urlopen(f"http://{router.host}:{router.metrics_port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_a_black_holed_store_fails_limited_tenants_closed_and_bills_everything_once_it_returns():
    if binaries() is None:
        pytest.skip("PostgreSQL's initdb/pg_ctl are not installed (Debian package `postgresql`)")
    with postgres_server() as url:
        server = make_url(url)
        with BlackHoleProxy(server.host, server.port) as proxy:
            store = Store(url)              # the test's own way in, around the proxy
            keys, prefixes = {}, {}
            for tenant in (Tenant("free"), Tenant("capped", rpm=100_000), Tenant("doomed")):
                store.add_tenant(tenant)
                keys[tenant.name], prefixes[tenant.name] = store.create_key(tenant.name)
            config = cluster_config(model=bench_model())
            config.router.metrics_port = 0
            config.store.url = server.set(port=proxy.port).render_as_string(hide_password=False)
            config.store.connect_timeout_s, config.store.statement_timeout_s = 2, 1
            config.store.refresh_s, config.store.stale_s = REFRESH_S, STALE_S
            config.auth.required, config.auth.admin_key = True, "admin-secret-for-tests"
            config.billing.flush_seconds = 0.2
            with LocalCluster(config, quiet=True) as cluster:
                served: dict[str, tuple[str, int, int]] = {}     # request id -> (tenant, prompt, completion)

                def note(tenant: str, reply) -> None:
                    status, headers, body, _took = reply
                    assert status == 200, (tenant, status, body)
                    served[headers["x-request-id"]] = (tenant, body["usage"]["prompt_tokens"],
                                                       body["usage"]["completion_tokens"])

                for name in keys:
                    note(name, ask(cluster, keys[name]))
                before = len(served)

                proxy.black_hole()
                holed = time.monotonic()
                store.revoke_key(prefixes["doomed"])           # while the router cannot see
                refused_at, slowest = None, 0.0
                while time.monotonic() - holed < OUTAGE_S:
                    reply = ask(cluster, keys["free"])
                    note("free", reply)
                    slowest = max(slowest, reply[3])
                    status, headers, body, took = ask(cluster, keys["capped"])
                    slowest = max(slowest, took)
                    if refused_at is None and status == 503:
                        refused_at = time.monotonic() - holed
                        assert body["error"]["type"] == "service_unavailable" and "tenant store" in \
                            body["error"]["message"] and int(headers["retry-after"]) >= 1, body
                    elif refused_at is None:
                        note("capped", (status, headers, body, took))
                    else:
                        assert status == 503, body            # refused until the store is back
                note("doomed", ask(cluster, keys["doomed"]))   # revocation unseen: the cached key still passes
                # What reads the store itself is a 503 saying when to retry; a response asked to be
                # kept is answered all the same, unkept.
                status, headers, body = call(cluster, "GET", "/v1/usage", keys["free"])
                assert status == 503 and body["error"]["code"] == "store_unavailable", body
                assert int(headers["retry-after"]) >= 1
                assert call(cluster, "GET", "/v1/responses/resp_x", keys["free"])[0] == 503
                status, headers, body = call(cluster, "POST", "/v1/responses", keys["free"], {
                    "model": Path(cluster.config.model).name, "input": "Hello", "max_output_tokens": 3})
                assert status == 200 and body["status"] in ("completed", "incomplete"), body
                served[headers["x-request-id"]] = ("free", body["usage"]["input_tokens"], body["usage"]["output_tokens"])
                during, outage_served = metrics(cluster), len(served)

                proxy.restore()
                restored = time.monotonic()
                while time.monotonic() - restored < 30:
                    status, headers, body, took = ask(cluster, keys["capped"])
                    if status == 200:
                        note("capped", (status, headers, body, took))
                        break
                    time.sleep(0.2)
                back_after = time.monotonic() - restored
                revoked = 0
                while time.monotonic() - restored < 30:
                    reply = ask(cluster, keys["doomed"])
                    if reply[0] != 200:
                        revoked = reply[0]
                        break
                    note("doomed", reply)                  # until the first refresh after the outage
                    time.sleep(0.2)
                while time.monotonic() - restored < 30 and metrics(cluster)["qos_ledger_pending_rows"]:
                    time.sleep(0.2)
                after = metrics(cluster)

            rows = store.ledger_rows()
            spent = store.spent()
            store.close()

    outage_requests = outage_served - before
    # Served throughout, each answer within COMMIT_WAIT_S (2 s) + a step of the model.
    assert slowest < 4.0, slowest
    # Limited tenant: served until the copy was stale_s old (read up to refresh_s before the hole).
    assert refused_at is not None and STALE_S - REFRESH_S - 0.5 <= refused_at <= STALE_S + 2.0, refused_at
    assert during["qos_store_limits_failing_closed"] == 1 and during["qos_store_seconds_since_read"] >= STALE_S
    assert outage_requests - 1 <= during["qos_ledger_pending_rows"] <= outage_requests
    assert during["qos_ledger_unconfirmed_total"] >= 1
    # After: limits apply again, the revocation too, and every answered request has one row with the
    # tokens its client was told; each tenant's running total equals its rows.
    assert back_after < 20 and revoked == 401
    assert after["qos_ledger_pending_rows"] == 0 and after["qos_ledger_rows_dropped_total"] == 0
    assert after["qos_ledger_rows_refused_total"] == 0 and after["qos_store_limits_failing_closed"] == 0
    assert sorted(r["request_id"] for r in rows) == sorted(served)
    assert {r["request_id"]: (r["tenant"], r["prompt_tokens"], r["completion_tokens"]) for r in rows} == served
    by_tenant: dict[str, float] = {}
    for r in rows:
        by_tenant[r["tenant"]] = by_tenant.get(r["tenant"], 0.0) + r["amount"]
    assert spent.keys() == by_tenant.keys()
    assert all(spent[t] == pytest.approx(by_tenant[t]) for t in spent)
