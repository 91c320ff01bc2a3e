"""The router's SLA watch: every finished request goes into the windows (services/control/sla.py),
an evaluation task judges the objectives once a second (services/control/alerts.py), and each
transition is logged, exported to Prometheus, kept for Router.Alerts and posted to the webhooks
(services/control/webhooks.py)."""
from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client.core import GaugeMetricFamily

from services.common.config import AlertsConfig, SlaConfig
from services.common.metrics import StateCollector
from services.common.priority import PRIORITIES
from services.common.proto.qos.v1 import router_pb2
from services.control.alerts import Alert, AlertBook
from services.control.sla import ALL_TENANTS, Outcome, objectives_of
from services.control.webhooks import WebhookSender

log = logging.getLogger(__name__)


class SlaMonitor:
    def __init__(self, contracts: list[SlaConfig], alerts: AlertsConfig, registry: CollectorRegistry,
                 external_url: str = ""):
        self.book = AlertBook.of(objectives_of(contracts))
        self.every_s = alerts.evaluate_every_s
        notifications = PromCounter("qos_alert_notifications", "Alert webhook notifications, by outcome",
                                    ("outcome",), registry=registry)
        self.webhooks = WebhookSender(alerts.webhooks, alerts.webhook_timeout_s, alerts.webhook_retries,
                                      external_url, lambda outcome: notifications.labels(outcome).inc())
        # What success_rate counts, for Prometheus rules equivalent to the built-in evaluation.
        self.requests = PromCounter("qos_sla_requests", "Requests as the SLA success rate counts them",
                                    ("priority", "outcome"), registry=registry)
        registry.register(StateCollector(self._gauges))

    def record(self, priority: str, outcome: Outcome) -> None:
        self.requests.labels(priority, "served" if outcome.served else "failed").inc()
        self.book.windows.record(priority, outcome)

    def evaluate(self, now: float | None = None) -> list[Alert]:
        changed = self.book.evaluate(time.time() if now is None else now)
        for alert in changed:
            if alert.state == "firing":
                log.warning("SLA alert FIRING [%s]: %s (breached since %.0f s ago)", alert.fingerprint,
                            alert.summary, alert.starts_at - alert.breach_since)
            else:
                why = ("no request in its window: its traffic stopped" if alert.silent
                       else "met with the margin")
                log.warning("SLA alert resolved [%s]: %s (fired for %.0f s; %s)", alert.fingerprint,
                            alert.summary, alert.ends_at - alert.starts_at, why)
            self.webhooks.notify(alert)
        return changed

    async def run(self) -> None:
        sender = asyncio.create_task(self.webhooks.run())
        try:
            while True:
                await asyncio.sleep(self.every_s)
                self.evaluate()
        finally:
            sender.cancel()

    def _gauges(self):
        families = {
            "qos_sla_objective": GaugeMetricFamily("qos_sla_objective", "SLA objective (ms, or a share "
                                                   "for success_rate)", labels=["priority", "tenant", "objective"]),
            "qos_sla_observed": GaugeMetricFamily("qos_sla_observed", "Observed over the SLA window (NaN: "
                                                  "too few requests)", labels=["priority", "tenant", "objective"]),
            "qos_sla_breached": GaugeMetricFamily("qos_sla_breached", "1 while the SLA alert fires",
                                                  labels=["priority", "tenant", "objective"])}
        for s in self.book.states:
            labels = [s.objective.priority, s.objective.tenant, s.objective.name]
            families["qos_sla_objective"].add_metric(labels, s.objective.target)
            families["qos_sla_observed"].add_metric(labels, float("nan") if s.observed is None else s.observed)
            families["qos_sla_breached"].add_metric(labels, 1.0 if s.state == "firing" else 0.0)
        yield from families.values()

    def reply_to(self, caller, auth_required: bool) -> router_pb2.AlertsReply:
        """Router.Alerts and GET /v1/alerts for a caller (services/control/tenancy.py's Caller):
        the admin reads every objective; a tenant's key its own; with auth off, anyone else the
        class-wide ones only (x-tenant proves nothing: no tenant's objectives to whoever names it)."""
        return self.reply(caller.scope if caller.admin or auth_required else ALL_TENANTS)

    def reply(self, tenant: str | None) -> router_pb2.AlertsReply:
        """Everything (tenant None), or the objectives labelled `tenant` (ALL_TENANTS: the class-wide)."""
        visible = lambda objective: tenant is None or objective.tenant == tenant   # noqa: E731
        objectives = [router_pb2.SlaObjectiveState(
            priority=PRIORITIES[s.objective.priority], tenant=s.objective.tenant, objective=s.objective.name,
            target=s.objective.target, observed=s.observed or 0.0, has_verdict=s.observed is not None,
            requests=s.requests, state=s.state, window_s=s.objective.contract.window_s,
            for_seconds=s.objective.contract.for_seconds) for s in self.book.states if visible(s.objective)]
        alerts = self.book.open_alerts() + list(reversed(self.book.resolved))
        return router_pb2.AlertsReply(objectives=objectives, alerts=[alert_proto(a) for a in alerts
                                                                    if visible(a.objective)])


def alert_proto(alert: Alert) -> router_pb2.SlaAlert:
    o = alert.objective
    return router_pb2.SlaAlert(
        fingerprint=alert.fingerprint, state=alert.state, priority=PRIORITIES[o.priority], tenant=o.tenant,
        objective=o.name, target=o.target, observed=alert.observed, starts_at_unix_s=alert.starts_at,
        ends_at_unix_s=alert.ends_at or 0.0, summary=alert.summary, breach_since_unix_s=alert.breach_since)

