"""Bad input gets INVALID_ARGUMENT (or FAILED_PRECONDITION) with a message naming the field."""
from __future__ import annotations

import grpc
import pytest

from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.tools.client import chat_request, sampling_params
from services.local.cluster import LocalCluster
from tests.e2e.conftest import cluster_config, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    # 64 MiB of KV: 1,456 tokens of SmolLM2 in fp32, 2,912 in bf16; either way less than the
    # 8,192-token context, so a request can fit the context and still not the pool.
    with LocalCluster(cluster_config(kv_cache_mb=64), quiet=True) as running:
        yield running


async def call(address: str, request, metadata=(), serializer=None):
    """One Generate call, drained; returns (status code, details)."""
    async with grpc.aio.insecure_channel(address) as channel:
        generate = channel.unary_stream(
            "/qos.v1.Router/Generate",
            request_serializer=serializer or router_pb2.GenerateRequest.SerializeToString,
            response_deserializer=common_pb2.GenerateChunk.FromString)
        try:
            async for _ in generate(request, metadata=metadata):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def ask(**sampling) -> router_pb2.GenerateRequest:
    return chat_request("Hello", sampling_params(**sampling))


@pytest.mark.parametrize("request_, metadata, field", [
    (ask(max_tokens=4), [("x-priority", "urgent")], "x-priority 'urgent'"),
    (router_pb2.GenerateRequest(prompt=""), [], "prompt is empty"),
    (router_pb2.GenerateRequest(prompt="hi", messages=[common_pb2.ChatMessage(role="user", content="x")]),
     [], "one of prompt, messages and prompt_token_ids"),
    (router_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="robot", content="x")]), [],
     "messages[0].role"),
    # A message quoting 40,000 characters came back as RESOURCE_EXHAUSTED: gRPC's metadata limit.
    (router_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="r" * 40_000, content="x")]), [],
     "messages[0].role"),
    (router_pb2.GenerateRequest(prompt="word " * 9000), [], "context window is 8192 tokens"),
    (ask(max_tokens=0), [], "sampling.max_tokens must be > 0"),
    (ask(max_tokens=-3), [], "sampling.max_tokens must be > 0"),
    # The router refuses max_tokens past the context itself only for a dense request: a request
    # left to its class's default may be served in streaming mode (the scheduler decides).
    (ask(max_tokens=10_000), [("x-context-mode", "dense")], "sampling.max_tokens=10000 exceeds the model's context window"),
    (ask(max_tokens=10_000), [], "sampling.max_tokens=10000 does not fit"),
    (ask(max_tokens=4), [("x-context-mode", "sliding")], "x-context-mode 'sliding'"),
    (ask(max_tokens=4), [("x-tenant", "t" * 65)], "x-tenant is 65 characters long"),
    (ask(max_tokens=8180), [], "sampling.max_tokens=8180 does not fit"),
    (ask(temperature=-0.5), [], "sampling.temperature"),
    (ask(top_p=0.0), [], "sampling.top_p"),
    (ask(top_p=1.5), [], "sampling.top_p"),
    (ask(top_k=-1), [], "sampling.top_k"),
    (ask(stop=["END", "x" * 1025]), [], "sampling.stop[1] is 1025 characters long, at most 1024"),
    (ask(stop=["s"] * 17), [], "sampling.stop has 17 strings, at most 16"),
    # A stop id past the vocabulary never stopped anything: the request ran to max_tokens, silently.
    (ask(max_tokens=4, stop_token_ids=[2, 49152]), [], "sampling.stop_token_ids[1]=49152 is not a token id"),
    (ask(max_tokens=4, stop_token_ids=[-1]), [], "sampling.stop_token_ids[0] must be a token id >= 0"),
    (ask(max_tokens=4, stop_token_ids=list(range(65))), [], "sampling.stop_token_ids has 65 ids, at most 64"),
])
def test_invalid_argument_names_the_field(cluster, request_, metadata, field):
    code, details = run(call(cluster.router_address, request_, metadata))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert field in details


@pytest.mark.parametrize("raw, field", [
    (router_pb2.GenerateRequestBytes(prompt=b"caf\xc3"), "prompt is not valid UTF-8"),
    (router_pb2.GenerateRequestBytes(messages=[router_pb2.ChatMessageBytes(
        role=b"user", content=b"ok \xff")]), "messages[0].content is not valid UTF-8"),
])
def test_invalid_utf8_names_the_field(cluster, raw, field):
    code, details = run(call(cluster.router_address, raw,
                             serializer=router_pb2.GenerateRequestBytes.SerializeToString))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in details


def test_more_kv_than_the_pool_has_is_resource_exhausted(cluster):
    stats = run(cluster.pool_stats())
    assert stats.kv_blocks_total * stats.block_size < 8000 < stats.max_context   # what the test needs
    # Fits the context window, but not the worker's KV blocks.
    code, details = run(call(cluster.router_address, ask(max_tokens=8000)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV blocks" in details


def test_unknown_model_is_failed_precondition(cluster):
    request = router_pb2.GenerateRequest(prompt="hi", model="gpt-17")
    code, details = run(call(cluster.router_address, request))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'gpt-17'" in details
    code, details = run(call(cluster.router_address, router_pb2.GenerateRequest(prompt="hi", model="m" * 60_000)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "characters cut" in details, details[:200]


def test_valid_request_still_succeeds(cluster):
    code, _ = run(call(cluster.router_address, ask(max_tokens=3, temperature=0.0), [("x-priority", "HIGH")]))
    assert code == grpc.StatusCode.OK
