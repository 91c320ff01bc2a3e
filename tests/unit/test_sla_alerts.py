"""SLA objectives and their alerts on made-up time: a breach held for_seconds opens exactly one
alert, recovery resolves it once, a value wobbling around the line does not spam; the webhook
gets Alertmanager's payload, retried until the receiver takes it."""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from prometheus_client import CollectorRegistry

from services.common.config import AlertsConfig, SlaConfig
from services.common.config_file import parse_config
from services.common.errors import ErrorKind, ServiceError
from services.common.priority import ADMIN_TENANT
from services.control.alerts import AlertBook
from services.control.sla import Outcome, counts_against_sla, objectives_of
from services.control.sla_monitor import SlaMonitor
from services.control.tenancy import Caller
from services.control.webhooks import NEVER, WebhookSender, payload
from services.store.store import Tenant


def book_of(**contract) -> AlertBook:
    defaults = dict(priority="high", ttft_p99_ms=200.0, window_s=10.0, for_seconds=5.0, min_requests=5)
    return AlertBook.of(objectives_of([SlaConfig(**{**defaults, **contract})]))


def second(book: AlertBook, now: float, ttft_ms: float, requests: int = 10, tenant: str = "acme",
           served: bool = True) -> list:
    """`requests` High requests end at `now` with this TTFT; then the book is judged."""
    for _ in range(requests):
        book.windows.record("high", Outcome(now, tenant, served, ttft_ms=ttft_ms, e2e_ms=ttft_ms * 2))
    return book.evaluate(now)


def test_a_breach_that_holds_for_seconds_opens_exactly_one_alert():
    book = book_of()
    changes = [second(book, t, 400.0) for t in range(0, 30)]
    fired = [alert for step in changes for alert in step]
    assert len(fired) == 1 and fired[0].state == "firing"
    assert [i for i, step in enumerate(changes) if step] == [5]       # for_seconds after the breach began
    assert fired[0].breach_since == 0 and fired[0].starts_at == 5 and fired[0].observed == 400.0
    assert "TTFT P99 is 400 ms" in fired[0].summary and "objective <= 200 ms" in fired[0].summary


def test_a_breach_shorter_than_for_seconds_opens_none():
    book = book_of(window_s=1.0)
    changes = [second(book, t, 400.0 if t < 4 else 100.0) for t in range(0, 20)]
    assert not any(changes) and book.states[0].state == "ok"


def test_recovery_resolves_it_once_after_resolve_seconds():
    book = book_of(window_s=2.0, resolve_seconds=3.0)
    fired = [a for t in range(0, 10) for a in second(book, t, 400.0)]
    changes = {t: second(book, t, 100.0) for t in range(10, 30)}
    resolved = [(t, a) for t, step in changes.items() for a in step]
    # The window still holds slow requests until t=12; then 3 s of meeting the objective.
    assert len(fired) == 1 and len(resolved) == 1
    t, alert = resolved[0]
    assert t == 15 and alert is fired[0] and alert.state == "resolved" and alert.ends_at == 15
    assert list(book.resolved) == [alert] and book.open_alerts() == []


def test_a_value_wobbling_around_the_line_does_not_spam():
    book = book_of(window_s=0.5, for_seconds=3.0, hysteresis=0.1)      # each second judged alone
    # Below the line one second, above it the next: never breached for 3 s in a row.
    wobble = [second(book, t, 210.0 if t % 2 else 190.0) for t in range(0, 40)]
    assert not any(wobble)
    # Held above the line: it fires; then wobbling around the line neither resolves nor reopens it,
    # since resolving needs the value below 200 x (1 - 0.1) = 180.
    fired = [a for t in range(40, 45) for a in second(book, t, 250.0)]
    wobble = [a for t in range(45, 100) for a in second(book, t, 210.0 if t % 2 else 190.0)]
    assert len(fired) == 1 and wobble == [] and book.states[0].state == "firing"
    assert book.states[0].transitions == 1
    resolved = [a for t in range(100, 110) for a in second(book, t, 150.0)]
    assert [a.state for a in resolved] == ["resolved"]


def test_sparse_traffic_judges_an_open_alert_on_the_few_requests_there_are():
    book = book_of(window_s=10.0, for_seconds=0.0, resolve_seconds=2.0)
    (fired,) = second(book, 0, 900.0)
    # One slow request every 3 s: too few for a verdict, but slow: the alert stays open.
    held = [a for t in range(1, 40) for a in (second(book, t, 900.0, requests=1) if t % 3 == 0 else book.evaluate(t))]
    assert held == [] and book.states[0].state == "firing"
    # Traffic stops: once the window holds no request (t=40, the last at t=39 leaves after 10 s)
    # and 2 s more: resolved, as having gone silent.
    after = {t: book.evaluate(t) for t in range(40, 60)}
    ((t, (resolved,)),) = [(t, step) for t, step in after.items() if step]
    assert t == 52 and resolved is fired and resolved.silent
    # Sparse but fast requests resolve it too.
    book = book_of(window_s=10.0, for_seconds=0.0, resolve_seconds=2.0)
    second(book, 0, 900.0)
    fast = {t: second(book, t, 50.0, requests=1) for t in range(1, 30)}
    ((t, (resolved,)),) = [(t, step) for t, step in fast.items() if step]
    assert t == 13 and not resolved.silent     # the slow ones leave at t=11, then 2 s


def test_too_few_requests_give_no_verdict_and_no_alert():
    book = book_of(min_requests=20)
    assert not any(second(book, t, 900.0, requests=1) for t in range(0, 30))
    assert book.states[0].observed is None and book.states[0].requests == 11     # t = 19..29


def test_success_rate_counts_the_service_failures_only():
    book = book_of(ttft_p99_ms=None, success_rate=0.99, for_seconds=0.0)
    for _ in range(95):
        book.windows.record("high", Outcome(0, "acme", True, ttft_ms=50.0))
    for _ in range(5):
        book.windows.record("high", Outcome(0, "acme", False))
    (alert,) = book.evaluate(0)
    assert alert.observed == 0.95 and "success rate is 95.00%" in alert.summary
    overloaded = ServiceError(ErrorKind.EXHAUSTED, "queue full", reason="queue_full")
    own_limit = ServiceError(ErrorKind.EXHAUSTED, "over rpm", reason="rate_limit_requests")
    assert counts_against_sla(overloaded) and counts_against_sla(ServiceError(ErrorKind.UNAVAILABLE, "gone"))
    assert not counts_against_sla(own_limit)
    assert not counts_against_sla(ServiceError(ErrorKind.INVALID, "bad", field="max_tokens"))


def test_a_tenant_objective_judges_that_tenant_only():
    book = book_of(tenant="acme", for_seconds=0.0)
    for t in range(5):
        assert second(book, t, 900.0, tenant="other") == []
    (alert,) = second(book, 6, 900.0, tenant="acme")
    assert alert.objective.labels == {"priority": "high", "tenant": "acme", "objective": "ttft_p99_ms"}


@pytest.mark.parametrize("auth_required", [False, True])
def test_each_caller_reads_the_objectives_it_may(auth_required):
    contracts = [SlaConfig(priority="high", ttft_p99_ms=500.0),
                 *(SlaConfig(priority="low", ttft_p99_ms=900.0, tenant=name) for name in ("acme", "globex"))]
    monitor = SlaMonitor(contracts, AlertsConfig(), CollectorRegistry())
    read = lambda caller: sorted(o.tenant for o in monitor.reply_to(caller, auth_required).objectives)  # noqa: E731
    assert read(Caller(Tenant(ADMIN_TENANT), admin=True)) == ["*", "acme", "globex"]   # the admin: all, auth on or off
    # A tenant's key reads its own; with auth off, naming a tenant (x-tenant) proves nothing.
    assert read(Caller(Tenant("acme"))) == (["acme"] if auth_required else ["*"])


def test_sla_config_is_checked_by_name():
    contracts = parse_config({"sla": [{"priority": "medium", "e2e_p99_ms": 5000, "success_rate": 0.99}]}).sla
    assert [(o.priority, o.name) for o in objectives_of(contracts)] == [("medium", "e2e_p99_ms"),
                                                                        ("medium", "success_rate")]
    assert parse_config({}).sla[0].ttft_p99_ms == 200.0            # the default contract: High
    assert parse_config({"sla": []}).sla == []                    # none: no SLA alerts
    with pytest.raises(ValueError, match="sla.0..hysteresis"):
        parse_config({"sla": [{"ttft_p99_ms": 100, "hysteresis": 2}]})


class Receiver(BaseHTTPRequestHandler):
    """A webhook receiver that fails its first `fail_first` POSTs with 500."""
    received: list = []
    fail_first = 0

    def do_POST(self):            # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        cls = type(self)
        if cls.fail_first > 0:
            cls.fail_first -= 1
            self.send_response(500)
        else:
            cls.received.append(body)
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_webhook_gets_alertmanagers_payload_with_retries():
    book = book_of(for_seconds=0.0, window_s=1.0, resolve_seconds=0.0)
    Receiver.received, Receiver.fail_first = [], 2
    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    outcomes = []

    async def go():
        sender = WebhookSender([f"http://127.0.0.1:{server.server_port}/hook"], timeout_s=2, retries=3,
                               on_outcome=outcomes.append)
        (fired,) = second(book, 100.0, 400.0)
        sender.notify(fired)                  # the payload is made now, as the router does
        sent_first = payload(fired)
        (resolved,) = second(book, 102.0, 100.0)
        sender.notify(resolved)
        await sender.flush(timeout_s=20)
        return sent_first
    try:
        sent_first = asyncio.run(go())
    finally:
        server.shutdown()
    assert outcomes == ["sent", "sent"] and len(Receiver.received) == 2
    first, last = Receiver.received
    assert first == sent_first and first["version"] == "4" and first["status"] == "firing"
    (alert,) = first["alerts"]
    assert alert["labels"] == {"alertname": "QosSlaBreached", "priority": "high", "tenant": "*",
                               "objective": "ttft_p99_ms", "severity": "page"}
    assert alert["endsAt"] == NEVER and alert["startsAt"].endswith("Z") and alert["annotations"]["observed"] == "400"
    assert last["status"] == "resolved" and last["alerts"][0]["endsAt"] != NEVER
    assert last["alerts"][0]["fingerprint"] == alert["fingerprint"]


def test_a_receiver_that_stays_down_is_given_up_without_blocking():
    book = book_of(for_seconds=0.0)
    (fired,) = second(book, 0.0, 400.0)
    outcomes = []

    async def go():
        sender = WebhookSender(["http://127.0.0.1:9/nothing-listens"], timeout_s=0.5, retries=1,
                               on_outcome=outcomes.append)
        sender.notify(fired)
        await sender.flush(timeout_s=10)
    asyncio.run(go())
    assert outcomes == ["failed"]
