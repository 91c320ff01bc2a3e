"""vLLM's metric names on the scheduler's /metrics, for what reads a model server as it reads
vLLM: the Gateway API Inference Extension's endpoint picker and llm-d's scheduler (queue depth
and KV use per server), the published KEDA recipes, vLLM's dashboards.

Names, types, units and histogram buckets are vLLM's (vllm/v1/metrics/loggers.py), with what it
counts: the token counters (prompt tokens when a request's first token comes, generated tokens
as they come, prefix-cache queries and hits in tokens, preemptions), the requests completed by
`finished_reason`, and per completed request its prompt and generation lengths and the times it
spent waiting, in prefill (first scheduled to first token), decoding and running. Labels:
`model_name` as vLLM's (the model this pool serves, the `id` /v1/models lists) and `pool`, one
series each for the gauges and token counters, since readers take one sample per server; the
per-request series add our class (`priority`), which `sum by (le)` folds away. The length
histograms' 1-2-5 buckets run to 10^6 tokens where vLLM stops at the model's context (streaming
mode has no such bound). They repeat numbers our own metrics carry (qos_queue_depth, qos_running,
qos_ttft_seconds, qos_e2e_seconds, qos_cache_hit_tokens, ...) under the names others read.
vllm:lora_requests_info is vLLM's too: a gauge at the scrape time (unix seconds) whose labels
name the adapters of the running and waiting requests and max_lora (the fewest a connected
worker holds at once): what LoRA-aware endpoint pickers read (the Gateway API Inference
Extension's). Not here: vllm:time_per_output_token_seconds (vLLM observes every token's gap; we
time requests).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.priority import ORDER
from services.common.step import FinishReason
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.stats import kv_blocks_in_use, running_by_priority

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(top: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `top` (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


LENGTH_BUCKETS = buckets_1_2_5(10**6)
FINISHED = (FinishReason.STOP, FinishReason.LENGTH)     # a completed request's; their labels are vLLM's


class VllmRequestMetrics:
    """vLLM's per-request series, per class: observed when a request completes."""

    def __init__(self, registry: CollectorRegistry, model_name: str, pool: str):
        self.labels = (model_name, pool)
        names = ("model_name", "pool", "priority")

        def histogram(name: str, text: str, buckets) -> Histogram:
            return Histogram(name, text, names, buckets=buckets, registry=registry)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             E2E_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", E2E_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", E2E_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", E2E_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", E2E_BUCKETS)
        self.prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", LENGTH_BUCKETS)
        self.generation = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                    LENGTH_BUCKETS)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               (*names, "finished_reason"), registry=registry)
        self._series: dict[str, tuple] = {}

    def finished(self, priority: str, ttft_s: float, e2e_s: float, queue_s: float = 0.0,
                 prompt_tokens: int = 0, generated: int = 0, reason: FinishReason = FinishReason.STOP) -> None:
        """A completed request: arrival to first token (`ttft_s`) and to its end (`e2e_s`), of which
        `queue_s` waiting to be first scheduled."""
        series = self._series.get(priority)
        if series is None:      # each class's series looked up once (a lookup costs as much as a sample)
            labels = (*self.labels, priority)
            series = self._series[priority] = (
                [h.labels(*labels) for h in (self.ttft, self.e2e, self.queue, self.prefill, self.decode,
                                             self.inference, self.prompt, self.generation)],
                {r: self.success.labels(*labels, r.label) for r in FINISHED})
        histograms, success = series
        for histogram, observed in zip(histograms, (ttft_s, e2e_s, queue_s, ttft_s - queue_s, e2e_s - ttft_s,
                                                    e2e_s - queue_s, prompt_tokens, generated)):
            histogram.observe(observed)
        success.get(reason, success[FinishReason.STOP]).inc()


def vllm_gauges(model_name: str, pool: str, batcher: ContinuousBatcher):
    """vllm:num_requests_waiting, vllm:num_requests_running and vllm:kv_cache_usage_perc, and the
    token counters, read at scrape time. The KV figure is a fraction (1 means full) despite its
    name, as vLLM's is; idle blocks kept for prefix caching count as free, as vLLM counts its
    evictable cached blocks."""
    cache = batcher.prefix_cache
    for name, text, value in [
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", sum(batcher.prompt_tokens.values())),
            ("vllm:generation_tokens", "Number of generation tokens processed.", sum(batcher.output_tokens.values())),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", batcher.preemptions),
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             sum(cache.queried.values()) if cache else 0),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             sum(cache.hits.values()) if cache else 0)]:
        family = CounterMetricFamily(name, text, labels=["model_name", "pool"])
        family.add_metric([model_name, pool], value)
        yield family
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


def lora_info(batcher: ContinuousBatcher):
    """vllm:lora_requests_info: one sample, labelled as vLLM labels it (adapters comma-joined,
    sorted), its value the time of the scrape."""
    running = {r.lora for requests in batcher.running.values() for r in requests if r.lora}
    waiting = {r.lora for lane in batcher.policy.lanes for r in batcher.policy.queue(lane) if r.lora}
    limits = [link.max_loras for link in batcher.links if link.is_connected]
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                               labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    family.add_metric([str(min(limits)) if limits else "0", ",".join(sorted(waiting)), ",".join(sorted(running))],
                      time.time())
    yield family
