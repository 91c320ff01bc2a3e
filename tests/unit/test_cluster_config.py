"""The cluster config: workers take their pool's device, KV budgets by device, precise errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, WorkerConfig
from services.common.config_file import load_config, parse_config

MiB = 2**20


def pool(pool_device: str, **worker) -> dict:
    return {"pools": [{"name": "p", "device": pool_device, "workers": [worker]}]}


@pytest.mark.parametrize("device", ["cpu", "cuda", "npu"])
def test_a_worker_without_a_device_runs_on_its_pools(device):
    assert parse_config(pool(device)).pools[0].workers[0].device == device


def test_a_worker_on_another_device_than_its_pool_is_refused():
    with pytest.raises(ConfigError, match=r"pools\[0\].workers\[0\].device is 'cpu' but the pool is 'cuda'"):
        parse_config(pool("cuda", device="cpu"))


def test_a_worker_may_name_its_device_index():
    assert parse_config(pool("cuda", device="cuda:1")).pools[0].workers[0].device == "cuda:1"


@pytest.mark.parametrize("worker, budget", [
    ({}, (256 * MiB, 0.8)),                                      # CPU: a fixed budget
    ({"kv_cache_mb": 64}, (64 * MiB, 0.8)),
    ({"kv_cache_fraction": 0.2}, (None, 0.2)),                   # CPU by fraction, if asked
])
def test_cpu_kv_budget(worker, budget):
    assert parse_config(pool("cpu", **worker)).pools[0].workers[0].kv_budget() == budget


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_accelerators_take_a_share_of_free_memory_unless_told_otherwise(device):
    assert parse_config(pool(device)).pools[0].workers[0].kv_budget() == (None, 0.8)
    assert parse_config(pool(device, kv_cache_fraction=0.5)).pools[0].workers[0].kv_budget() == (None, 0.5)
    assert parse_config(pool(device, kv_cache_mb=1024)).pools[0].workers[0].kv_budget() == (1024 * MiB, 0.8)


def test_worker_config_made_in_code_keeps_the_cpu_default():
    assert WorkerConfig().kv_budget() == (256 * MiB, 0.8)


@pytest.mark.parametrize("worker, message", [
    ({"kv_cache_mb": 0}, "kv_cache_mb must be >= 1, got 0"),
    ({"kv_cache_mb": "big"}, "kv_cache_mb must be int, got 'big'"),
    ({"kv_cache_fraction": 1.5}, r"kv_cache_fraction must be in \(0, 1\]"),
    ({"kv_cache_fraction": "half"}, "kv_cache_fraction must be float, got 'half'"),
    ({"threads": -1}, "threads must be >= 0"),
    ({"max_loras": 0}, "max_loras must be >= 1, got 0"),
    ({"max_loras": 8, "max_cpu_loras": 4}, "need max_loras <= max_cpu_loras, got 8 and 4"),
    ({"gpus": 2}, "unknown key pools\\[0\\].workers\\[0\\].gpus"),
    ({"decode_attention": "fast"}, "decode_attention must be one of auto, kernel, torch, got 'fast'"),
])
def test_bad_worker_settings_name_the_key(worker, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(pool("cpu", **worker))


def test_a_worker_entry_that_is_not_a_table_is_refused():
    with pytest.raises(ConfigError, match="must be a table"):
        parse_config({"pools": [{"name": "p", "workers": ["cpu"]}]})


@pytest.mark.parametrize("raw, message", [
    ({"routers": {}}, "unknown key routers; known: adapters, alerts, auth, autoscale, batches, billing, model, pools, responses, router, "
                      "scheduler, security, sla, store, workers"),
    ({"pools": []}, "pools must be a non-empty list"),
    ({"pools": {"name": "p"}}, "pools must be a non-empty list"),
    ({"pools": [{"name": "a"}], "scheduler": {}}, "either \\[\\[pools\\]\\] or a single pool"),
    ({"pools": [{"name": "a"}, {"name": "a"}]}, "pool names must be unique"),
    ({"pools": [{"name": "a", "device": "tpu"}]}, "pools\\[0\\].device must be one of cuda, npu, cpu, got 'tpu'"),
    ({"pools": [{"name": "a", "workers": []}]}, "pools\\[0\\].workers must be a non-empty list"),
    ({"pools": [{"name": "a", "colour": "red"}]}, "unknown key pools\\[0\\].colour"),
])
def test_bad_top_level_and_pool_keys_are_named(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


@pytest.mark.parametrize("router, message", [
    ({"routing": "random"}, "router.routing must be one of cost, primary, slo-cost, got 'random'"),
    ({"admission": "lifo"}, "router.admission must be one of priority, fifo, got 'lifo'"),
    ({"scheduler_link": "pigeon"}, "router.scheduler_link must be one of stream, calls, got 'pigeon'"),
    ({"port": 70000}, "router.port must be in 0..65535 \\(0: a free port\\), got 70000"),
    ({"port": "50051"}, "router.port must be int, got '50051'"),
    ({"port": True}, "router.port must be int, got True"),
    ({"metrics_port": -2}, "router.metrics_port must be in 0..65535 \\(0: a free port\\), got -2"),
    ({"drain_seconds": -1}, "router.drain_seconds must be in 0..3600, got -1"),
    ({"drain_seconds": "long"}, "router.drain_seconds must be float, got 'long'"),
    ({"http_port": -2}, "router.http_port must be in -1..65535 \\(0: a free port, -1: off\\), got -2"),
    ({"http_max_body_bytes": 10}, "router.http_max_body_bytes must be >= 1024, got 10"),
    ({"https_port": 8443}, "unknown key router.https_port"),
    ([], "\\[router\\] must be a table"),
])
def test_bad_router_settings_name_the_key(router, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"router": router})


@pytest.mark.parametrize("scheduler, message", [
    ({"policy": "lottery"}, "pool.scheduler.policy must be one of qos, fcfs, got 'lottery'"),
    ({"weights": [5, 3]}, "pool.scheduler.weights must be 3 numbers \\(high, medium, low\\), each > 0"),
    ({"weights": [5, 0, 2]}, "pool.scheduler.weights must be 3 numbers \\(high, medium, low\\), each > 0"),
    ({"kv_caps": [1.0, 0.7, 1.5]}, "pool.scheduler.kv_caps must be 3 numbers \\(high, medium, low\\), each in \\(0, 1\\]"),
    ({"max_running": 0}, "pool.scheduler.max_running must be >= 1, got 0"),
    ({"max_running": 64, "max_step_tokens": 32}, "max_step_tokens >= max_running"),
    ({"max_queue": 0}, "pool.scheduler.max_queue must be >= 1, got 0"),
    ({"retry_after_ms": 0}, "pool.scheduler.retry_after_ms must be >= 1, got 0"),
    ({"max_queue": 1.5}, "pool.scheduler.max_queue must be int, got 1.5"),
    ({"drain_seconds": 7200}, "pool.scheduler.drain_seconds must be in 0..3600"),
    ({"workers": 2}, "unknown key pool.scheduler.workers"),
    ({"high_cut_in_slots": 1.5}, "pool.scheduler.high_cut_in_slots must be in 0..1, got 1.5"),
    ({"high_cut_in_slots": True}, "pool.scheduler.high_cut_in_slots must be float, got True"),
    ({"stream_intervals": [1, 4]}, "pool.scheduler.stream_intervals must be 3 whole numbers \\(high, medium, low\\), each in 1..2147483647"),
    ({"stream_intervals": [1, 0, 16]}, "pool.scheduler.stream_intervals must be 3 whole numbers"),
    ({"stream_intervals": [1, 2.5, 16]}, "pool.scheduler.stream_intervals must be 3 whole numbers"),
    ({"stream_max_hold_ms": -1}, "pool.scheduler.stream_max_hold_ms must be in 0..60000, got -1"),
    ({"long_prompts": ["refuse", "stream"]}, "pool.scheduler.long_prompts must be 3 of refuse, stream \\(high, medium, low\\)"),
    ({"long_prompts": ["refuse", "sliding", "stream"]}, "pool.scheduler.long_prompts must be 3 of refuse, stream"),
    ({"stream_window_tokens": 0}, "pool.scheduler.stream_window_tokens must be >= 1, got 0"),
    ({"stream_sink_tokens": -1}, "pool.scheduler.stream_sink_tokens must be >= 0, got -1"),
])
def test_bad_scheduler_settings_name_the_key(scheduler, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"scheduler": scheduler})


def test_drain_seconds_default_to_30_and_are_read_per_service():
    config = parse_config({"router": {"drain_seconds": 5}, "scheduler": {"drain_seconds": 12.5},
                           "workers": [{"drain_seconds": 0}]})
    assert config.router.drain_seconds == 5
    assert config.pools[0].scheduler.drain_seconds == 12.5
    assert config.pools[0].workers[0].drain_seconds == 0
    assert parse_config({}).router.drain_seconds == 30.0


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    config = load_config(path)
    assert config.pools and all(pool.workers for pool in config.pools)
