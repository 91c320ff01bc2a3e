"""vLLM's metric names on a scheduler's registry: what the exposition says, with vLLM's types,
buckets and labels, from a batcher's state (a stand-in with the parts they read)."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.kv_blocks import KVBlockPool
from services.common.metrics import StateCollector
from services.common.priority import HIGH, LOW, MEDIUM
from services.common.step import FinishReason
from services.scheduler.vllm_metrics import (E2E_BUCKETS, LENGTH_BUCKETS, TTFT_BUCKETS, VllmRequestMetrics,
                                             buckets_1_2_5, vllm_gauges)


def link(num_blocks: int, held: int, connected: bool = True):
    pool = KVBlockPool(num_blocks, 16)
    pool.allocate(MEDIUM, held)
    return SimpleNamespace(is_connected=connected, info=object(), pool=pool)


def batcher(waiting: dict, running: dict, links: list, cache=None, prompt=None, output=None, preemptions=0):
    policy = SimpleNamespace(waiting=lambda p: waiting.get(p, 0))
    return SimpleNamespace(policy=policy, links=links, prefix_cache=cache, prompt_tokens=Counter(prompt or {}),
                           output_tokens=Counter(output or {}), preemptions=preemptions,
                           running={i: [SimpleNamespace(priority=p) for p in ps] for i, ps in running.items()})


def exposition(registry: CollectorRegistry) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_the_gauges_sum_the_classes_and_kv_use_is_a_fraction_of_connected_workers():
    registry = CollectorRegistry()
    b = batcher({HIGH: 1, MEDIUM: 2, LOW: 4}, {0: [HIGH, LOW], 1: [MEDIUM]},
                [link(100, 30), link(60, 10), link(500, 400, connected=False)])
    registry.register(StateCollector(lambda: vllm_gauges("SmolLM2", "cpu", b)))
    families = exposition(registry)
    labels = {"model_name": "SmolLM2", "pool": "cpu"}
    for name, value in [("vllm:num_requests_waiting", 7), ("vllm:num_requests_running", 3),
                        ("vllm:kv_cache_usage_perc", 40 / 160)]:
        assert families[name].type == "gauge"
        assert [(s.labels, s.value) for s in families[name].samples] == [(labels, value)], name


def test_no_worker_is_no_kv_use():
    registry = CollectorRegistry()
    registry.register(StateCollector(lambda: vllm_gauges("m", "cpu", batcher({}, {}, []))))
    assert exposition(registry)["vllm:kv_cache_usage_perc"].samples[0].value == 0


def test_the_histograms_have_vllms_buckets_and_our_class_as_a_label():
    registry = CollectorRegistry()
    metrics = VllmRequestMetrics(registry, "SmolLM2", "cpu")
    metrics.finished("high", 0.03, 0.9)
    metrics.finished("high", 0.07, 1.2)
    metrics.finished("low", 3.0, 20.0)
    families = exposition(registry)
    for name, buckets, observed in [("vllm:time_to_first_token_seconds", TTFT_BUCKETS, {"high": 0.1, "low": 3.0}),
                                    ("vllm:e2e_request_latency_seconds", E2E_BUCKETS, {"high": 2.1, "low": 20.0})]:
        family = families[name]
        assert family.type == "histogram"
        bounds = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")})
        assert bounds == [*buckets, float("inf")]
        for priority, total in observed.items():
            labels = {"model_name": "SmolLM2", "pool": "cpu", "priority": priority}
            (count,) = [s.value for s in family.samples if s.name == name + "_count" and s.labels == labels]
            (summed,) = [s.value for s in family.samples if s.name == name + "_sum" and s.labels == labels]
            assert count == {"high": 2, "low": 1}[priority] and abs(summed - total) < 1e-9
    # vLLM's bounds, as vllm/v1/metrics/loggers.py sets them.
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert E2E_BUCKETS[:3] == (0.3, 0.5, 0.8) and E2E_BUCKETS[-1] == 7680.0 and len(E2E_BUCKETS) == 21


def test_the_token_counters_sum_the_classes_and_read_the_prefix_cache():
    registry = CollectorRegistry()
    cache = SimpleNamespace(queried=Counter({HIGH: 100, LOW: 300}), hits=Counter({LOW: 240}))
    b = batcher({}, {}, [], cache=cache, prompt={HIGH: 100, LOW: 300}, output={HIGH: 7, MEDIUM: 5}, preemptions=3)
    registry.register(StateCollector(lambda: vllm_gauges("m", "cpu", b)))
    families = exposition(registry)
    for name, value in [("vllm:prompt_tokens", 400), ("vllm:generation_tokens", 12), ("vllm:num_preemptions", 3),
                        ("vllm:prefix_cache_queries", 400), ("vllm:prefix_cache_hits", 240)]:
        family = families[name]
        assert family.type == "counter"
        assert [(s.name, s.value) for s in family.samples if s.name.endswith("_total")] == [(name + "_total", value)]
    registry = CollectorRegistry()       # without prefix caching: nothing queried, nothing hit
    registry.register(StateCollector(lambda: vllm_gauges("m", "cpu", batcher({}, {}, []))))
    assert exposition(registry)["vllm:prefix_cache_hits"].samples[0].value == 0


def test_a_completed_request_is_split_into_vllms_phases_and_counted_by_its_reason():
    registry = CollectorRegistry()
    metrics = VllmRequestMetrics(registry, "m", "cpu")
    metrics.finished("medium", ttft_s=0.5, e2e_s=2.0, queue_s=0.2, prompt_tokens=120, generated=30,
                     reason=FinishReason.LENGTH)
    metrics.finished("medium", ttft_s=0.1, e2e_s=0.4, queue_s=0.0, prompt_tokens=8, generated=3)
    families = exposition(registry)

    def summed(name):
        return sum(s.value for s in families[name].samples if s.name == name + "_sum")

    assert summed("vllm:request_queue_time_seconds") == 0.2
    assert abs(summed("vllm:request_prefill_time_seconds") - 0.4) < 1e-9       # first scheduled -> first token
    assert abs(summed("vllm:request_decode_time_seconds") - 1.8) < 1e-9        # first token -> end
    assert abs(summed("vllm:request_inference_time_seconds") - 2.2) < 1e-9     # first scheduled -> end
    assert summed("vllm:request_prompt_tokens") == 128 and summed("vllm:request_generation_tokens") == 33
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"}
    assert success == {"length": 1, "stop": 1}
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100) and LENGTH_BUCKETS[-1] == 10**6


def test_lora_info_names_the_adapters_running_and_waiting_and_the_fewest_a_worker_holds():
    from services.scheduler.vllm_metrics import lora_info
    queued = {0: [SimpleNamespace(lora="sql"), SimpleNamespace(lora="")], 1: [SimpleNamespace(lora="chat")]}
    policy = SimpleNamespace(lanes=(0, 1), queue=lambda lane: queued[lane])
    links = [SimpleNamespace(is_connected=True, max_loras=4), SimpleNamespace(is_connected=True, max_loras=2),
             SimpleNamespace(is_connected=False, max_loras=1)]
    running = {0: [SimpleNamespace(lora="sql"), SimpleNamespace(lora="math")], 1: [SimpleNamespace(lora="")]}
    b = SimpleNamespace(policy=policy, links=links, running=running)
    registry = CollectorRegistry()
    registry.register(StateCollector(lambda: lora_info(b)))
    (sample,) = exposition(registry)["vllm:lora_requests_info"].samples
    assert sample.labels == {"max_lora": "2", "waiting_lora_adapters": "chat,sql", "running_lora_adapters": "math,sql"}
    assert sample.value > 1.7e9              # the time of the scrape, as vLLM sets it
