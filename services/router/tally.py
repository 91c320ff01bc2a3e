"""The router's bookkeeping, kept apart from the request path: per priority, pool and tenant
counters (Router.Stats), the Prometheus request metrics, and the request span's attributes.

The request path makes one `Tally` per request and tells it what happens: `on_routed`,
`on_chunk`, then exactly one of `on_done`, `on_fail`, `on_cancel`.

Per tenant rows cover the tenants seen lately, not every name ever sent (with auth off any
x-tenant is a tenant): a tenant none of whose requests started, ended or was refused for
TENANT_IDLE_S is forgotten, and beyond MAX_TENANT_ROWS the least recently seen goes first. What a
tenant used since it began is the ledger's to tell (/v1/usage). No Prometheus series here is
labelled by tenant (priority, pool and reason only), so the metrics do not grow with tenants.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.trace import Span, Status, StatusCode
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter

from services.common.errors import ErrorKind, ServiceError
from services.common.idle_keys import IdleKeys
from services.common.metrics import RequestMetrics
from services.common.percentile import percentile
from services.common.priority import ORDER, priority_name
from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.control.sla import Outcome, counts_against_sla

LATENCY_WINDOW = 10_000        # most recent requests per group kept for percentiles
RECENT = 50                    # finished requests kept for the console
FINISHED_WINDOW = 20_000       # (time, class, TTFT, e2e) of recent completions: the console's minute
PREDICTION_ERROR_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000)
TENANT_IDLE_S = 600.0          # a tenant's row is kept this long after its last request
MAX_TENANT_ROWS = 10_000       # and at most this many rows (each holds up to 2 x LATENCY_WINDOW samples)


@dataclass(slots=True, frozen=True)
class FinishedRequest:
    """One request that ended, as the console lists it."""
    request_id: str
    priority: str
    tenant: str
    pool: str
    status: str                # completed | failed: REASON | cancelled
    ttft_ms: float | None
    tokens: int
    at: float                  # unix seconds
    trace_id: str              # 32 hex digits, for a link into Jaeger


class Counters:
    """Requests, tokens, cost and latency samples for one priority, pool or tenant."""

    def __init__(self) -> None:
        self.requests = self.completed = self.failed = self.cancelled = self.output_tokens = 0
        self.cost_units = 0.0
        self.ttft_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.e2e_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)

    def to_priority_proto(self, priority: int) -> router_pb2.PriorityStats:
        return router_pb2.PriorityStats(
            priority=priority, requests=self.requests, completed=self.completed, failed=self.failed,
            cancelled=self.cancelled, output_tokens=self.output_tokens, cost_units=self.cost_units,
            ttft_p50_ms=percentile(self.ttft_ms, 0.50), ttft_p95_ms=percentile(self.ttft_ms, 0.95),
            ttft_p99_ms=percentile(self.ttft_ms, 0.99), e2e_p50_ms=percentile(self.e2e_ms, 0.50),
            e2e_p95_ms=percentile(self.e2e_ms, 0.95), e2e_p99_ms=percentile(self.e2e_ms, 0.99))

    def to_group_proto(self, name: str) -> router_pb2.GroupStats:
        return router_pb2.GroupStats(
            name=name, requests=self.requests, completed=self.completed, failed=self.failed,
            output_tokens=self.output_tokens, cost_units=self.cost_units,
            ttft_p50_ms=percentile(self.ttft_ms, 0.50), ttft_p99_ms=percentile(self.ttft_ms, 0.99),
            e2e_p99_ms=percentile(self.e2e_ms, 0.99))


class RouterTotals:
    """Everything the router counts, since it started."""

    def __init__(self, pool_names: list[str], sla=None, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.sla = sla                   # SlaMonitor: every finished request is judged against the SLAs
        self.clock = clock               # when tenants were seen (tests pass their own)
        self.by_priority = {p: Counters() for p in ORDER}
        self.by_pool = {name: Counters() for name in pool_names}
        self.by_tenant: dict[str, Counters] = {}
        # Tenants by when one of their requests last started, ended or was refused.
        self.tenant_seen = IdleKeys(TENANT_IDLE_S)
        self.registry = registry or CollectorRegistry()
        self.metrics = RequestMetrics(self.registry, ("priority", "pool"))
        self.migrations = PromCounter("qos_migrations", "Requests moved to another pool mid-way",
                                      ("from_pool", "to_pool"), registry=self.registry)
        self.migrated = 0
        # The latency model's error (services/router/latency_model.py): |actual - predicted| time
        # to first token of each completed request whose pool had a prediction, and the margin
        # each pool's predictions are multiplied by.
        self.prediction_error = Histogram(
            "qos_route_prediction_error_ms", "Routing latency model: |actual - predicted| TTFT, ms",
            ("pool", "priority"), buckets=PREDICTION_ERROR_BUCKETS_MS, registry=self.registry)
        self.prediction_margin = Gauge("qos_route_prediction_margin", "Routing latency model: the "
                                       "factor predictions are multiplied by (P99 of actual/predicted)",
                                       ("pool",), registry=self.registry)
        self.rejected: Counter = Counter()       # (class or "unknown", reason) -> requests refused
        self.limits_hit: Counter = Counter()     # tenant -> requests refused by its own limits
        self.recent: deque[FinishedRequest] = deque(maxlen=RECENT)
        self.finished: deque[tuple[float, int, float, float]] = deque(maxlen=FINISHED_WINDOW)

    def start(self, priority: int, tenant: str, span: Span, request_id: str = "") -> Tally:
        return Tally(self, priority, tenant, span, request_id)

    def seen(self, tenant: str) -> None:
        now = self.clock()
        self.tenant_seen.see(tenant, now)
        self.forget_idle(now)

    def tenant_row(self, tenant: str, row: Counters | None = None) -> Counters:
        """The tenant's row, now seen; `row` (a request's own, when it ends) is put back if the
        tenant was forgotten while the request ran, so what it did is not lost."""
        self.seen(tenant)
        found = self.by_tenant.get(tenant)
        if found is None:
            found = self.by_tenant[tenant] = row if row is not None else Counters()
        return found

    def forget_idle(self, now: float) -> None:
        """Forget the tenants not seen for TENANT_IDLE_S, and the least recently seen beyond
        MAX_TENANT_ROWS."""
        for tenant in self.tenant_seen.idle(now, keep=MAX_TENANT_ROWS):
            self.by_tenant.pop(tenant, None)
            self.limits_hit.pop(tenant, None)
        if self.tenant_seen.compact():
            self.by_tenant, self.limits_hit = dict(self.by_tenant), Counter(self.limits_hit)

    def reject(self, priority_label: str, reason: str) -> None:
        self.metrics.rejections.labels(priority_label, reason).inc()
        self.rejected[(priority_label, reason)] += 1

    def refused_early(self, error: ServiceError, priority: int | None = None, tenant: str = "") -> None:
        """Refused before it was admitted: a bad header, no key, a limit."""
        self.reject(priority_name(priority) if priority else "unknown", error.reason)
        if tenant and error.reason.startswith(("rate_limit", "insufficient_quota", "priority_not_allowed")):
            self.seen(tenant)
            self.limits_hit[tenant] += 1

    def stats_proto(self, pools, threshold: float) -> router_pb2.RouterStats:
        return router_pb2.RouterStats(
            priorities=[self.by_priority[p].to_priority_proto(p) for p in ORDER],
            pools=pools, by_pool=[c.to_group_proto(n) for n, c in self.by_pool.items()],
            by_tenant=[c.to_group_proto(n) for n, c in sorted(self.by_tenant.items())],
            overflow_threshold=threshold, migrations=self.migrated)


class Tally:
    """One request's share of the totals."""

    def __init__(self, totals: RouterTotals, priority: int, tenant: str, span: Span, request_id: str = ""):
        self.totals = totals
        self.tenant = tenant
        self.request_id = request_id
        self.priority = priority
        self.name = priority_name(priority)
        self.span = span
        self.pool = ""
        self.started = time.perf_counter()
        self.started_wall = time.time()
        self.first_token_s: float | None = None
        self.predicted_ttft_ms: float | None = None         # the pool's latency model's prediction
        self.prompt_tokens = self.completion_tokens = 0    # as far as known (usage comes first)
        self.cached_tokens = 0                              # of prompt_tokens, from the prefix cache
        self.outcome = ""                                   # completed | failed | cancelled
        self.tenant_group = totals.tenant_row(tenant)
        self.groups = [totals.by_priority[priority], self.tenant_group]
        for group in self.groups:
            group.requests += 1
        span.set_attributes({"qos.priority": self.name, "qos.tenant": tenant})

    def on_routed(self, pool: str, predicted_ttft_ms: float | None = None) -> None:
        self.pool = pool
        self.predicted_ttft_ms = predicted_ttft_ms
        group = self.totals.by_pool[pool]
        group.requests += 1
        self.groups.append(group)
        self.span.set_attribute("qos.pool", pool)

    def on_chunk(self, chunk: common_pb2.GenerateChunk) -> None:
        if chunk.usage.prompt_tokens:
            self.prompt_tokens = chunk.usage.prompt_tokens
            self.cached_tokens = chunk.usage.cached_tokens
        if not chunk.token_ids:
            return
        self.completion_tokens += len(chunk.token_ids)
        elapsed_ms = (time.perf_counter() - self.started) * 1000
        for group in self.groups:
            group.output_tokens += len(chunk.token_ids)
            if self.first_token_s is None:
                group.ttft_ms.append(elapsed_ms)
        if self.first_token_s is None:
            self.first_token_s = elapsed_ms / 1000
        self.totals.metrics.tokens.labels(self.name, self.pool).inc(len(chunk.token_ids))

    def _ended(self) -> None:
        """Its tenant was seen now; if its row was forgotten meanwhile (a request longer than
        TENANT_IDLE_S), the request ends in the tenant's row of now."""
        row = self.totals.tenant_row(self.tenant, self.tenant_group)
        if row is not self.tenant_group:
            self.groups[self.groups.index(self.tenant_group)] = self.tenant_group = row

    def on_done(self, chunk: common_pb2.GenerateChunk) -> None:
        self._ended()
        self.outcome = "completed"
        self.completion_tokens = chunk.usage.completion_tokens
        self.cached_tokens = chunk.usage.cached_tokens
        elapsed_s = time.perf_counter() - self.started
        for group in self.groups:
            group.completed += 1
            group.e2e_ms.append(elapsed_s * 1000)
            group.cost_units += chunk.cost_units
        ttft_s = self.first_token_s if self.first_token_s is not None else elapsed_s
        if self.predicted_ttft_ms is not None and self.first_token_s is not None:
            self.totals.prediction_error.labels(self.pool, self.name).observe(
                abs(ttft_s * 1000 - self.predicted_ttft_ms))
        self.totals.metrics.finished((self.name, self.pool), ttft_s, elapsed_s,
                                     chunk.usage.completion_tokens)
        self.span.set_attributes({"qos.prompt_tokens": chunk.usage.prompt_tokens,
                                  "qos.cached_tokens": chunk.usage.cached_tokens,
                                  "qos.output_tokens": chunk.usage.completion_tokens,
                                  "qos.cost_units": chunk.cost_units, "qos.ttft_ms": ttft_s * 1000})
        tokens = chunk.usage.completion_tokens
        self._judge(True, ttft_ms=ttft_s * 1000, e2e_ms=elapsed_s * 1000,
                    tpot_ms=(elapsed_s - ttft_s) * 1000 / (tokens - 1) if tokens > 1 else None)
        self.totals.finished.append((time.time(), self.priority, ttft_s * 1000, elapsed_s * 1000))
        self._list("completed")

    def on_migrated(self, from_pool: str, to_pool: str, error: ServiceError) -> None:
        """The request moved to another pool mid-way (its first could not continue it): the pool
        it left counts it as failed, the one it moves to as its own from now on."""
        left = self.totals.by_pool[from_pool]
        left.failed += 1
        self.groups.remove(left)
        self.totals.migrations.labels(from_pool, to_pool).inc()
        self.totals.migrated += 1
        self.span.add_event("migration", {"qos.migration.from": from_pool, "qos.migration.to": to_pool,
                                          "qos.migration.reason": error.message})
        self.on_routed(to_pool)

    def on_fail(self, error: ServiceError) -> None:
        self._ended()
        self.outcome = "failed"
        for group in self.groups:
            group.failed += 1
        self.span.set_status(Status(StatusCode.ERROR, f"{error.kind.status.grpc}: {error.message}"))
        if self.pool:
            self.totals.metrics.requests.labels(self.name, self.pool, "failed").inc()
        if error.kind in (ErrorKind.INVALID, ErrorKind.UNSUPPORTED, ErrorKind.EXHAUSTED,
                          ErrorKind.TOO_LARGE) or error.reason == "draining":
            self.totals.reject(self.name, error.reason)
        if counts_against_sla(error):
            self._judge(False)      # latency objectives judge completed requests, as the histograms do
        self._list(f"failed: {error.reason}")

    def _list(self, status: str) -> None:
        context = self.span.get_span_context()
        self.totals.recent.append(FinishedRequest(
            self.request_id, self.name, self.tenant, self.pool, status,
            self.first_token_s * 1000 if self.first_token_s is not None else None,
            self.completion_tokens, time.time(), f"{context.trace_id:032x}" if context.trace_id else ""))

    def _judge(self, served: bool, **latency) -> None:
        if self.totals.sla is not None:
            self.totals.sla.record(self.name, Outcome(time.time(), self.tenant, served, **latency))

    def on_cancel(self) -> None:
        self._ended()
        self.outcome = "cancelled"
        for group in self.groups:
            group.cancelled += 1
        if self.pool:
            self.totals.metrics.requests.labels(self.name, self.pool, "cancelled").inc()
        self._list("cancelled")
