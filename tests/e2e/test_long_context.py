"""Streaming mode end to end (router, scheduler, worker as processes): a Low request longer than
the model's context is served in streaming mode by the class's default and says so in its usage
on both fronts; High refuses it with a hint, or streams when asked (x-context-mode, or the HTTP
body's context_mode); the KV it holds stays within the window's bound. The bench model (4,096
positions) with a 256-token window keeps it quick."""
from __future__ import annotations

import asyncio

import grpc
import openai
import pytest

from services.common.stream_window import StreamWindow
from services.local.cluster import LocalCluster
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import bench_model, cluster_config, openai_client, run

pytestmark = pytest.mark.slow

WINDOW = StreamWindow(4, 256)
CHUNK = 128
DOCUMENT = "Summarise this log. " + " ".join(f"entry {i} reads value {i * 7 % 101}." for i in range(900))


@pytest.fixture(scope="module")
def cluster():
    # fp32: the tests compare greedy texts of requests batched differently, equal only where the
    # numbers do not depend on the batch.
    config = cluster_config(model=bench_model(), dtype="fp32", stream_window_tokens=WINDOW.window_tokens,
                            stream_chunk_tokens=CHUNK)
    with LocalCluster(config, quiet=True) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    with openai_client(cluster, timeout=300) as api:
        yield api


def generate(cluster, priority: str, context_mode: str | None = None, max_tokens: int = 24):
    async def go():
        async with RouterClient(cluster.router_address) as c:
            return await c.generate(chat_request(DOCUMENT, sampling_params(max_tokens=max_tokens, temperature=0.0,
                                                                           ignore_eos=True)),
                                    priority=priority, context_mode=context_mode)
    return run(go())


def test_low_streams_a_document_longer_than_the_context(cluster):
    first, again = generate(cluster, "low"), generate(cluster, "low")
    assert first.prompt_tokens > 4096, "the document must pass the bench model's context"
    assert first.finish_reason == "length" and len(first.token_ids) == 24
    assert first.streaming == (WINDOW.sink_tokens, WINDOW.window_tokens)
    assert again.token_ids == first.token_ids           # greedy, whatever else ran beside it


def test_two_documents_at_once_hold_their_bound(cluster):
    async def both():
        async with RouterClient(cluster.router_address) as c:
            request = chat_request(DOCUMENT, sampling_params(max_tokens=40, temperature=0.0, ignore_eos=True))
            return await asyncio.gather(*(c.generate(request, priority="low") for _ in range(2)))
    answers = run(both())
    assert answers[0].token_ids == answers[1].token_ids

    pool = run(cluster.pool_stats())
    low = pool.classes[2]
    bound = WINDOW.max_blocks(CHUNK, pool.block_size)
    assert 0 < low.kv_blocks_peak <= 2 * bound, "a document's whole text would need ~330 blocks"
    assert pool.kv_blocks_used == 0


def test_high_refuses_a_long_prompt_and_says_how_to_stream(cluster):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        generate(cluster, "high")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context window is 4096 tokens" in caught.value.details()
    assert "x-context-mode: streaming" in caught.value.details()
    asked = generate(cluster, "high", context_mode="streaming", max_tokens=8)
    assert asked.streaming == (4, 256) and len(asked.token_ids) == 8


def test_http_body_asks_for_streaming_and_usage_says_so(cluster, client):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": DOCUMENT}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                       extra_headers={"x-priority": "high"})
    assert "context_mode" in str(caught.value) or "x-context-mode" in str(caught.value)
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                            extra_headers={"x-priority": "high"},
                                            extra_body={"context_mode": "streaming", "ignore_eos": True})
    assert answer.usage.completion_tokens == 8
    assert answer.usage.model_extra["streaming"] == {"sink_tokens": 4, "window_tokens": 256}
    with pytest.raises(openai.BadRequestError, match="differ"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                       extra_headers={"x-context-mode": "dense"},
                                       extra_body={"context_mode": "streaming"})
    short = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, extra_headers={"x-priority": "low"})
    assert "streaming" not in (short.usage.model_extra or {}), "a short Low request is served dense"


def test_the_command_line_sends_a_document_and_says_it_streamed(cluster, tmp_path):
    import subprocess
    import sys
    document = tmp_path / "log.txt"
    document.write_text(DOCUMENT)
    result = subprocess.run([sys.executable, "-m", "services.tools.cli", "generate", "--router",
                             cluster.router_address, "--priority", "low", "--max-tokens", "4",
                             "--file", str(document), "Summarise this log."],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "streaming mode: 4 sinks + a 256-token window" in result.stderr
