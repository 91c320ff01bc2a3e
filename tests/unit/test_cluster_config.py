"""The cluster config: workers take their pool's device, KV budgets by device, precise errors."""
from __future__ import annotations

import pytest

from services.common.config import ConfigError, WorkerConfig, parse_config

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
    ({"kv_cache_mb": 0}, "kv_cache_mb must be a positive integer"),
    ({"kv_cache_mb": "big"}, "kv_cache_mb must be a positive integer"),
    ({"kv_cache_fraction": 1.5}, r"kv_cache_fraction must be in \(0, 1\]"),
    ({"kv_cache_fraction": "half"}, r"kv_cache_fraction must be in \(0, 1\]"),
    ({"threads": -1}, "threads must be >= 0"),
    ({"gpus": 2}, "unknown key pools\\[0\\].workers\\[0\\].gpus"),
])
def test_bad_worker_settings_name_the_key(worker, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(pool("cpu", **worker))


def test_a_worker_entry_that_is_not_a_table_is_refused():
    with pytest.raises(ConfigError, match="must be a table"):
        parse_config({"pools": [{"name": "p", "workers": ["cpu"]}]})
