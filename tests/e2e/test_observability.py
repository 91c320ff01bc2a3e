"""Prometheus endpoints on every service, and the `qos-serve stats` table, on a real cluster."""
from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool
from services.local.cluster import LocalCluster
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import run

pytestmark = pytest.mark.slow

SENT = {"high": 3, "medium": 2, "low": 4}


@pytest.fixture(scope="module")
def loaded_cluster():
    config = single_pool(router=RouterConfig(port=0, http_port=0, metrics_port=0),
                         # Chunks held for their stream interval however long it takes: exact counts.
                         scheduler=SchedulerConfig(port=0, metrics_port=0, stream_max_hold_ms=60_000),
                         workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=128, metrics_port=0)])
    with LocalCluster(config, quiet=True) as cluster:
        async def load():
            async with RouterClient(cluster.router_address) as client:
                await asyncio.gather(*[
                    client.generate(chat_request(f"Say {i}", sampling_params(max_tokens=6, ignore_eos=True)),
                                    priority=p) for p, n in SENT.items() for i in range(n)])
        run(load())
        yield cluster


def scrape(host: str, port: int) -> dict:
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def by_priority(samples: dict, name: str, **fixed) -> dict:
    out = {}
    for (sample, labels), value in samples.items():
        labels = dict(labels)
        if sample == name and all(labels.get(k) == v for k, v in fixed.items()):
            out[labels["priority"]] = out.get(labels["priority"], 0) + value
    return out


def test_router_and_scheduler_histograms_count_every_request(loaded_cluster):
    config = loaded_cluster.config
    router = scrape(config.router.host, config.router.metrics_port)
    scheduler_cfg = config.pools[0].scheduler
    scheduler = scrape(scheduler_cfg.host, scheduler_cfg.metrics_port)
    for samples in (router, scheduler):
        for histogram in ("qos_ttft_seconds_count", "qos_e2e_seconds_count",
                          "qos_time_per_output_token_seconds_count"):
            assert by_priority(samples, histogram) == SENT, histogram
    assert by_priority(scheduler, "qos_tokens_served_total")["low"] > 0
    assert by_priority(scheduler, "qos_weight") == {"high": 5, "medium": 3, "low": 2}
    assert by_priority(scheduler, "qos_queue_depth") == {"high": 0, "medium": 0, "low": 0}
    # 6 tokens each: High a message per token, Medium the first then 4 + 1, Low the first then 5
    # (fewer where the Submit handler merged chunks that queued up).
    assert by_priority(router, "qos_output_tokens_total") == {p: 6 * n for p, n in SENT.items()}
    chunks = by_priority(scheduler, "qos_stream_chunks_total")
    assert SENT["high"] <= chunks["high"] <= 6 * SENT["high"]
    assert SENT["medium"] <= chunks["medium"] <= 3 * SENT["medium"]
    assert SENT["low"] <= chunks["low"] <= 2 * SENT["low"]


def test_worker_exposes_step_metrics(loaded_cluster):
    worker = loaded_cluster.config.pools[0].workers[0]
    samples = scrape(worker.host, worker.metrics_port)
    assert samples[("qos_worker_step_seconds_count", ())] > 0
    assert samples[("qos_worker_active_sequences", ())] == 0
    # The wait for the next plan, between steps with work (the first after idle is no wait).
    waits = samples[("qos_worker_plan_wait_seconds_count", ())]
    assert 0 < waits < samples[("qos_worker_step_seconds_count", ())]
    assert samples[("qos_worker_plan_wait_seconds_sum", ())] > 0


def test_every_service_froze_its_startup_heap_and_times_its_collections(loaded_cluster):
    """services/common/gc_pauses.py: once serving, each process's startup objects are out of the
    collector's scans, and every collection since its metrics started is counted by generation."""
    config = loaded_cluster.config
    scheduler, worker = config.pools[0].scheduler, config.pools[0].workers[0]
    young = {}
    for name, service in (("router", config.router), ("scheduler", scheduler), ("worker", worker)):
        samples = scrape(service.host, service.metrics_port)
        assert samples[("qos_gc_frozen_objects", ())] > 10_000, name
        young[name] = samples[("qos_gc_pause_seconds_count", (("generation", "0"),))]
        # Every collection lands in a bucket: the +Inf one counts them all.
        assert samples[("qos_gc_pause_seconds_bucket", (("generation", "0"), ("le", "+Inf")))] == young[name]
        assert (samples[("qos_gc_pause_seconds_sum", (("generation", "0"),))] > 0) == (young[name] > 0), name
    # The router allocates for every request and chunk it relays: its young generation filled.
    assert young["router"] > 0, young


def test_stats_command_shows_the_cluster_per_priority(loaded_cluster):
    out = subprocess.run([sys.executable, "-m", "services.tools.cli", "stats", "--router",
                          loaded_cluster.router_address], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.strip()}
    for priority, count in SENT.items():
        row = lines[priority]
        assert row[1] == str(count)          # requests
    assert "weight" in out.stdout and "pool cpu" in out.stdout


def test_an_answer_not_streamed_costs_two_messages_and_x_stream_interval_sets_a_streams(loaded_cluster):
    """Over HTTP: `"stream": false` asks the scheduler for the first chunk and the last only (this
    cluster holds chunks without a time limit), where a High stream sends one per token; the
    X-Stream-Interval header sets a streamed request's interval."""
    config = loaded_cluster.config
    scheduler = config.pools[0].scheduler

    def high_chunks() -> float:
        return by_priority(scrape(scheduler.host, scheduler.metrics_port), "qos_stream_chunks_total")["high"]

    def post(stream: bool, headers: dict) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(config.router.host, config.router.http_port, timeout=60)
        try:
            conn.request("GET", "/v1/models")
            model = json.loads(conn.getresponse().read())["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 12,
                    "ignore_eos": True, "stream": stream}
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                         headers={"content-type": "application/json", "x-priority": "high", **headers})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    before = high_chunks()
    status, body = post(False, {})
    whole = high_chunks()
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 12
    assert 1 <= whole - before <= 2                     # per token it would be 12
    status, body = post(True, {"x-stream-interval": "4"})
    deltas = [line for line in body.decode().splitlines() if line.startswith("data: {")]
    assert status == 200 and deltas
    assert 1 <= high_chunks() - whole <= 1 + 3          # the first, then 4, 4 and the last 3
