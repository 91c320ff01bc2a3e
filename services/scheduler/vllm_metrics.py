"""vLLM's metric names on the scheduler's /metrics, for what reads a model server as it reads
vLLM: the Gateway API Inference Extension's endpoint picker and llm-d's scheduler (queue depth
and KV use per server), the published KEDA recipes, vLLM's dashboards.

Names, types, units and histogram buckets are vLLM's (vllm/v1/metrics/loggers.py). Labels:
`model_name` as vLLM's (the model this pool serves, the `id` /v1/models lists) and `pool`, one
series each for the gauges, since readers take one sample per server; the histograms add our
class (`priority`), which `sum by (le)` folds away. They repeat numbers our own metrics carry
(qos_queue_depth, qos_running, qos_ttft_seconds, qos_e2e_seconds) under the names others read.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily

from services.common.priority import ORDER
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.stats import kv_blocks_in_use, running_by_priority

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class VllmRequestMetrics:
    """vllm:time_to_first_token_seconds and vllm:e2e_request_latency_seconds, per class."""

    def __init__(self, registry: CollectorRegistry, model_name: str, pool: str):
        self.labels = (model_name, pool)
        names = ("model_name", "pool", "priority")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token "
                              "in seconds.", names, buckets=TTFT_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency "
                             "in seconds.", names, buckets=E2E_BUCKETS, registry=registry)

    def finished(self, priority: str, ttft_s: float, e2e_s: float) -> None:
        self.ttft.labels(*self.labels, priority).observe(ttft_s)
        self.e2e.labels(*self.labels, priority).observe(e2e_s)


def vllm_gauges(model_name: str, pool: str, batcher: ContinuousBatcher):
    """vllm:num_requests_waiting, vllm:num_requests_running and vllm:kv_cache_usage_perc, read
    at scrape time. The KV figure is a fraction (1 means full) despite its name, as vLLM's is; idle
    blocks kept for prefix caching count as free, as vLLM counts its evictable cached blocks."""
    used, total = kv_blocks_in_use(batcher)
    for name, text, value in [
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             sum(batcher.policy.waiting(p) for p in ORDER)),
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             sum(running_by_priority(batcher).values())),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             used / total if total else 0.0)]:
        family = GaugeMetricFamily(name, text, labels=["model_name", "pool"])
        family.add_metric([model_name, pool], value)
        yield family
