"""Alert notifications: each transition (fired, resolved) POSTed as JSON to every URL in
`[alerts] webhooks`, in the shape of Prometheus Alertmanager's webhook (version "4"), so receivers
written for Alertmanager (chat bots, incident tools) read it as is:

    {"version": "4", "status": "firing", "receiver": "qos-serve", "groupKey": "...",
     "groupLabels": {"alertname": "QosSlaBreached"}, "commonLabels": {...}, "commonAnnotations": {...},
     "externalURL": "...", "truncatedAlerts": 0,
     "alerts": [{"status": "firing", "labels": {"alertname": "QosSlaBreached", "priority": "high",
                 "tenant": "*", "objective": "ttft_p99_ms", "severity": "page"},
                 "annotations": {"summary": "...", "observed": "312.4", "objective": "200"},
                 "startsAt": "2026-11-30T01:02:03.000Z", "endsAt": "0001-01-01T00:00:00Z",
                 "generatorURL": "...", "fingerprint": "..."}]}

Sending never blocks a request: transitions go into a bounded queue that one task drains, each
POST in a helper thread, retried with exponential backoff (0.5, 1, 2, 4 ... s, at most 30 s).
A receiver that stays down loses nothing else: its notifications are dropped after the last try,
counted in `qos_alert_notifications_total{outcome}` and logged.
"""
from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from datetime import datetime, timezone

from services.control.alerts import Alert

log = logging.getLogger(__name__)

ALERT_NAME = "QosSlaBreached"
QUEUE_LIMIT = 1000
NEVER = "0001-01-01T00:00:00Z"     # Alertmanager's endsAt of an alert still firing


def rfc3339(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def labels_of(alert: Alert) -> dict[str, str]:
    # High is the class that pages someone; the others open a ticket.
    severity = "page" if alert.objective.priority == "high" else "ticket"
    return {"alertname": ALERT_NAME, **alert.objective.labels, "severity": severity}


def annotations_of(alert: Alert) -> dict[str, str]:
    return {"summary": alert.summary, "observed": f"{alert.observed:g}",
            "objective": f"{alert.objective.target:g}",
            "window_seconds": f"{alert.objective.contract.window_s:g}"}


def payload(alert: Alert, external_url: str = "") -> dict:
    """One alert's transition as an Alertmanager webhook message."""
    labels, annotations = labels_of(alert), annotations_of(alert)
    return {
        "version": "4", "status": alert.state, "receiver": "qos-serve",
        "groupKey": "{}:{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}",
        "truncatedAlerts": 0, "groupLabels": {"alertname": ALERT_NAME}, "commonLabels": labels,
        "commonAnnotations": annotations, "externalURL": external_url,
        "alerts": [{"status": alert.state, "labels": labels, "annotations": annotations,
                    "startsAt": rfc3339(alert.starts_at),
                    "endsAt": rfc3339(alert.ends_at) if alert.ends_at is not None else NEVER,
                    "generatorURL": external_url, "fingerprint": alert.fingerprint}]}


def _post(url: str, body: bytes, timeout_s: float) -> None:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"content-type": "application/json", "user-agent": "qos-serve"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:   # noqa: S310 (http(s) checked in config)
        response.read()


class WebhookSender:
    """Posts alert transitions to the configured URLs, off the request path."""

    def __init__(self, urls: list[str], timeout_s: float, retries: int, external_url: str = "",
                 on_outcome=lambda outcome: None):
        self.urls, self.timeout_s, self.retries = list(urls), timeout_s, retries
        self.external_url = external_url
        self.on_outcome = on_outcome       # "sent" | "failed" | "dropped", for the counter
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(QUEUE_LIMIT)

    def notify(self, alert: Alert) -> None:
        if not self.urls:
            return
        if self.queue.full():
            self.queue.get_nowait()
            self.on_outcome("dropped")
            log.warning("alert webhook queue full (%d): dropped the oldest notification", QUEUE_LIMIT)
        self.queue.put_nowait(json.dumps(payload(alert, self.external_url)).encode())

    async def run(self) -> None:
        while True:
            body = await self.queue.get()
            for url in self.urls:
                await self._deliver(url, body)

    async def _deliver(self, url: str, body: bytes) -> None:
        for attempt in range(self.retries + 1):
            try:
                await asyncio.to_thread(_post, url, body, self.timeout_s)
                self.on_outcome("sent")
                return
            except Exception as exc:           # noqa: BLE001 (any failure: retry, then give up)
                if attempt == self.retries:
                    self.on_outcome("failed")
                    log.warning("alert webhook %s: giving up after %d tries: %s", url, attempt + 1, exc)
                    return
                await asyncio.sleep(min(30.0, 0.5 * 2 ** attempt))

    async def flush(self, timeout_s: float = 5.0) -> None:
        """On drain: give queued notifications a few seconds to go out."""
        try:
            async with asyncio.timeout(timeout_s):
                while not self.queue.empty():
                    body = self.queue.get_nowait()
                    for url in self.urls:
                        await self._deliver(url, body)
        except TimeoutError:
            log.warning("alert webhooks: %d notification(s) not sent at shutdown", self.queue.qsize())
