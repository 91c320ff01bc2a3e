"""bench/trace_replay.py against a real cluster (the bench model, one CPU worker), through --url and
--router as a user with a running cluster would: a hand-made Mooncake trace whose requests come
a second apart, so each finds what the ones before it computed; the server then serves exactly
what the ideal caches say (computed by hand below), and every class is answered."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.local.cluster import LocalCluster
from tests.e2e.conftest import bench_model, cluster_config

ROOT = Path(__file__).resolve().parents[2]

# 16 tokens per hash id, the server's block size: one hash id is one KV block.
TRACE = [
    {"timestamp": 0, "input_length": 3 * 512, "output_length": 64, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 5 * 512, "output_length": 64, "hash_ids": [0, 1, 2, 3, 4]},
    {"timestamp": 2000, "input_length": 2 * 512, "output_length": 64, "hash_ids": [0, 5]},
    {"timestamp": 3000, "input_length": 6 * 512, "output_length": 64, "hash_ids": [0, 1, 2, 3, 4, 6]},
]
# Prompts of 48, 80, 32, 96 tokens; blocks served (never a prompt's last one): 0, 3, 1, 5
IDEAL = (0 + 3 + 1 + 5) * 16 / (48 + 80 + 32 + 96)


def test_a_replay_is_served_what_the_ideal_cache_says(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    out = tmp_path / "result.json"
    with LocalCluster(cluster_config(model=bench_model()), quiet=True) as cluster:
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "trace_replay.py"), "--trace", str(trace),
             "--url", f"http://{cluster.router_http_addresses[0]}", "--router", cluster.router_address,
             "--model", bench_model(), "--tokens-per-hash", "16", "--json", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["failures"] == {} and result["ok"] == 4
    assert result["trace"]["block_tokens_exact"] == 1.0 and result["trace"]["truncated"] == 0
    assert result["prompt_tokens"] == 256
    assert result["unbounded_ideal_share"] == pytest.approx(IDEAL)
    assert result["bounded_ideal_share"] == pytest.approx(IDEAL)       # the pool holds it all
    assert result["served_cached_share"] == pytest.approx(IDEAL)
    assert {k: c["ok"] for k, c in result["classes"].items()} == {"high": 2, "medium": 1, "low": 1}
    assert all(c["ttft_p50_ms"] > 0 for c in result["classes"].values())
    assert "served 56.2%" in done.stdout
