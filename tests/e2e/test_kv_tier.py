"""A worker's second KV tier in a real cluster (the bench model, fp32, one CPU worker whose KV
pool holds 16 blocks): a prompt whose blocks the pool evicted under other prompts is served from
the tier the next time (cached tokens, the same greedy text as the first time), where the same
sequence without a tier computes it again; the scheduler's and the worker's metrics count the
copies."""
from __future__ import annotations

import http.client
import json
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from services.local.cluster import LocalCluster
from tests.e2e.conftest import bench_model, cluster_config, run

WORDS = "river stone cloud maple harbor lantern meadow copper violet orbit canyon ember".split()


def prompt(seed: int, words: int = 70) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] + str(seed) for i in range(words))


def complete(cluster, text: str) -> tuple[str, int, int]:
    router = cluster.config.router
    conn = http.client.HTTPConnection(router.host, router.http_port, timeout=120)
    try:
        body = {"model": Path(cluster.config.model).name, "prompt": text, "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        assert response.status == 200, answer
    finally:
        conn.close()
    usage = answer["usage"]
    return answer["choices"][0]["text"], usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def scrape(host: str, port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def replay(tier_mb: int) -> dict:
    config = cluster_config(kv_cache_mb=1, model=bench_model(), dtype="float32", metrics_port=0)
    worker = config.pools[0].workers[0]
    worker.kv_tier_mb, worker.metrics_port = tier_mb, 0
    with LocalCluster(config, quiet=True) as cluster:
        stats = run(cluster.pool_stats())
        first = complete(cluster, prompt(0))
        for seed in range(1, 5):                    # four other prompts: more than the pool holds
            complete(cluster, prompt(seed))
        again = complete(cluster, prompt(0))
        scheduler = cluster.config.pools[0].scheduler
        return {"blocks": stats.kv_blocks_total, "first": first, "again": again,
                "scheduler": scrape(scheduler.host, scheduler.metrics_port),
                "worker": scrape(worker.host, worker.metrics_port)}


def test_a_prefix_the_pool_evicted_comes_back_from_the_tier():
    without, with_tier = replay(0), replay(8)
    assert without["blocks"] == with_tier["blocks"] == 16
    text, cached, prompt_tokens = without["again"]
    assert prompt_tokens > 5 * 16 and cached == 0          # evicted: computed again
    assert without["scheduler"].get("qos_kv_tier_loaded_blocks_total", 0) == 0
    text_tier, cached_tier, _ = with_tier["again"]
    assert cached_tier == (prompt_tokens - 1) // 16 * 16    # its whole prefix, loaded back
    assert text_tier == with_tier["first"][0] == without["first"][0]
    scheduler, worker = with_tier["scheduler"], with_tier["worker"]
    assert scheduler["qos_kv_tier_loaded_blocks_total"] * 16 >= cached_tier
    assert scheduler["qos_kv_tier_hit_tokens_total"] == cached_tier
    assert worker["qos_worker_kv_tier_loaded_blocks_total"] == scheduler["qos_kv_tier_loaded_blocks_total"]
    assert worker["qos_worker_kv_tier_saved_blocks_total"] == scheduler["qos_kv_tier_saved_blocks_total"] > 0
    assert worker["qos_worker_kv_tier_blocks"] == 8 * 16    # 8 MiB of 64 KiB blocks
