"""Prometheus metrics: one registry and one HTTP endpoint per service process.

Latency histograms are observed on the request path (a few dict lookups); gauges and counters
that mirror state the service already keeps (queue depth, KV blocks per class, weights, tokens
served) are read at scrape time by a collector, so they cost nothing between scrapes.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.gc_pauses import watch_gc

log = logging.getLogger(__name__)

# Seconds; dense below 1 s where the High SLO (200 ms) lives.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                   7.5, 10.0, 20.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


class RequestMetrics:
    """TTFT, time per output token and end-to-end latency per priority (and pool)."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, ...]):
        self.ttft = Histogram("qos_ttft_seconds", "Time to first token", labels,
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("qos_time_per_output_token_seconds",
                              "Time per output token after the first", labels,
                              buckets=TOKEN_BUCKETS, registry=registry)
        self.e2e = Histogram("qos_e2e_seconds", "End-to-end request latency", labels,
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.requests = Counter("qos_requests_total", "Requests by outcome", (*labels, "outcome"),
                                registry=registry)
        self.rejections = Counter("qos_rejections_total", "Requests refused, by reason",
                                  ("priority", "reason"), registry=registry)
        self.tokens = Counter("qos_output_tokens_total", "Output tokens streamed", labels,
                              registry=registry)

    def finished(self, labels: tuple[str, ...], ttft_s: float, e2e_s: float, output_tokens: int) -> None:
        self.ttft.labels(*labels).observe(ttft_s)
        self.e2e.labels(*labels).observe(e2e_s)
        if output_tokens > 1:
            self.tpot.labels(*labels).observe((e2e_s - ttft_s) / (output_tokens - 1))
        self.requests.labels(*labels, "completed").inc()


class StateCollector(Collector):
    """Gauges and counters computed from live state at scrape time."""

    def __init__(self, read: Callable[[], Iterable[GaugeMetricFamily | CounterMetricFamily]]):
        self.read = read

    def collect(self):
        yield from self.read()


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None, service: str) -> int | None:
    """Expose `registry` on http://host:port/metrics; None or a negative port disables it."""
    if port is None or port < 0:
        return None
    watch_gc(registry)          # each collection's pause (services/common/gc_pauses.py)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[1]
    log.info("%s metrics on http://%s:%d/metrics", service, host, bound)
    return bound
