"""vLLM's metric names on a real scheduler's /metrics agree with its PoolStats and its own
histograms, and the official `openai` client's vLLM-style `priority` lands in its class."""
from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.priority import HIGH
from services.tools.client import RouterClient, chat_request, sampling_params
from services.local.cluster import LocalCluster
from tests.e2e.conftest import bench_model, cluster_config, openai_client, run

pytestmark = pytest.mark.slow

SENT = {"high": 2, "medium": 3, "low": 1}
MAX_RUNNING = 2


@pytest.fixture(scope="module")
def cluster():
    # One worker running at most 2 sequences: the rest of a burst waits, so the gauges have
    # something to show.
    config = cluster_config(model=bench_model(), metrics_port=0, max_running=MAX_RUNNING, high_cut_in=False)
    with LocalCluster(config, quiet=True) as running:
        yield running


def scrape(cluster) -> list:
    scheduler = cluster.config.pools[0].scheduler
    text = urllib.request.urlopen(f"http://{scheduler.host}:{scheduler.metrics_port}/metrics", timeout=5).read()
    return [s for family in text_string_to_metric_families(text.decode()) for s in family.samples]


def value(samples: list, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def test_vllm_histograms_count_each_request_as_ours_do(cluster):
    async def load():
        async with RouterClient(cluster.router_address) as client:
            await asyncio.gather(*[client.generate(chat_request(f"Say {i}", sampling_params(max_tokens=4)),
                                                   priority=p) for p, n in SENT.items() for i in range(n)])
    run(load())
    model = run(cluster.pool_stats()).model
    samples = scrape(cluster)
    for ours, theirs in [("qos_ttft_seconds", "vllm:time_to_first_token_seconds"),
                         ("qos_e2e_seconds", "vllm:e2e_request_latency_seconds")]:
        for priority, n in SENT.items():
            labels = {"model_name": model, "pool": "cpu", "priority": priority}
            assert value(samples, theirs + "_count", **labels) == n, (theirs, priority)
            assert value(samples, theirs + "_sum", **labels) == \
                pytest.approx(value(samples, ours + "_sum", priority=priority), rel=1e-9)
            assert value(samples, theirs + "_bucket", le="+Inf", **labels) == n
    # The token counters and per-request series agree with the pool's own counts.
    stats = run(cluster.pool_stats())
    pool = {"model_name": model, "pool": "cpu"}
    generated = sum(c.output_tokens for c in stats.classes)
    assert value(samples, "vllm:generation_tokens_total", **pool) == generated > 0
    assert value(samples, "vllm:request_generation_tokens_sum", **pool) == generated
    assert value(samples, "vllm:prompt_tokens_total", **pool) == value(samples, "vllm:request_prompt_tokens_sum", **pool) > 0
    assert value(samples, "vllm:prefix_cache_queries_total", **pool) == sum(c.cache_queried_tokens for c in stats.classes)
    assert value(samples, "vllm:prefix_cache_hits_total", **pool) == sum(c.cache_hit_tokens for c in stats.classes)
    assert value(samples, "vllm:num_preemptions_total", **pool) == stats.preemptions
    assert value(samples, "vllm:request_success_total", **pool) == sum(SENT.values())
    for phase in ("queue", "prefill", "decode", "inference"):
        assert value(samples, f"vllm:request_{phase}_time_seconds_count", **pool) == sum(SENT.values())
    (lora,) = [s for s in samples if s.name == "vllm:lora_requests_info"]      # no adapter here: none named
    assert lora.labels["running_lora_adapters"] == lora.labels["waiting_lora_adapters"] == ""
    assert int(lora.labels["max_lora"]) >= 1 and lora.value > 1.7e9


def test_vllm_gauges_agree_with_pool_stats_while_requests_wait_and_run(cluster):
    async def go():
        async with RouterClient(cluster.router_address) as client:
            # Long streams (cancelled below): 2 run, 4 wait, KV fills as they decode.
            streams = [asyncio.create_task(client.generate(
                chat_request(f"Count {i}", sampling_params(max_tokens=1500, ignore_eos=True)), priority=p))
                for i, p in enumerate(["medium", "low"] * 3)]
            try:
                return await agreeing_snapshot(cluster)
            finally:
                for stream in streams:
                    stream.cancel()
                await asyncio.gather(*streams, return_exceptions=True)
    stats, samples = run(go())
    labels = {"model_name": stats.model, "pool": "cpu"}
    waiting, running = sum(c.waiting for c in stats.classes), sum(c.running for c in stats.classes)
    assert (waiting, running) == (4, MAX_RUNNING)
    assert value(samples, "vllm:num_requests_waiting", **labels) == waiting
    assert value(samples, "vllm:num_requests_running", **labels) == running
    usage = value(samples, "vllm:kv_cache_usage_perc", **labels)
    assert 0 < usage < 1 and usage == pytest.approx(stats.kv_blocks_used / stats.kv_blocks_total, abs=1e-12)


async def agreeing_snapshot(cluster):
    """PoolStats and a scrape taken between two PoolStats that agree (the scheduler's state
    moves on as sequences decode): the scrape saw that state."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        before = await cluster.pool_stats()
        samples = await asyncio.to_thread(scrape, cluster)
        after = await cluster.pool_stats()
        shape = lambda s: ([(c.waiting, c.running) for c in s.classes], s.kv_blocks_used, s.kv_blocks_total)
        if shape(before) == shape(after) and sum(c.waiting for c in after.classes) == 4:
            return after, samples
        await asyncio.sleep(0.02)
    raise AssertionError("the pool never showed 2 running and 4 waiting in a stable moment")


def test_the_openai_clients_vllm_priority_lands_in_high(cluster):
    def class_tokens():
        return {c.priority: c.output_tokens for c in run(cluster.pool_stats()).classes}
    with openai_client(cluster) as client:
        model = client.models.list().data[0].id
        before = class_tokens()
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=3, extra_body={"priority": -1, "ignore_eos": True})
        after = class_tokens()
    assert answer.service_tier == "priority"
    assert {p: after[p] - before[p] for p in after} == {p: 3 if p == HIGH else 0 for p in after}
