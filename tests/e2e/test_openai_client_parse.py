"""The official `openai` client against the embedded model, as a new user would call it:
client.beta.chat.completions.parse(response_format=PydanticModel) returns a parsed object for 100
of 100 varied prompts, and a forced tool call (named, or "required") parses for 100 of 100
(bench/openai_structured.py does the calls; bench/results/openai_structured.json keeps a run)."""
from __future__ import annotations

import asyncio

import pytest

from bench.openai_structured import measure
from services.local.cluster import LocalCluster
from tests.e2e.conftest import cluster_config

pytestmark = pytest.mark.slow      # ~2 minutes here: 200 generations of the real model


def test_100_of_100_parse_and_100_of_100_forced_tool_calls_parse():
    with LocalCluster(cluster_config(kv_cache_mb=512), quiet=True) as cluster:
        router = cluster.config.router
        result = asyncio.run(measure(f"http://{router.host}:{router.http_port}/v1", 100))
    assert result["parse"]["parsed"] == 100, result["parse"]["failures"][:3]
    assert result["tool_calls"]["parsed"] == 100, result["tool_calls"]["failures"][:3]
