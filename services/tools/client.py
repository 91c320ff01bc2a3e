"""A small async client for the Router: stream one answer, with the priority in metadata."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.common.grpc_server import open_channel
from services.common.priority import CONTEXT_MODE_HEADER, PRIORITY_HEADER, SLO_HEADER, TENANT_HEADER
from services.common.proto.qos.v1 import common_pb2, router_pb2, router_pb2_grpc


@dataclass(slots=True)
class Answer:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    ttft_ms: float = 0.0          # measured by the client: request sent -> first token
    e2e_ms: float = 0.0           # request sent -> last chunk
    server_timings: common_pb2.Timings | None = None
    pool: str = ""
    cost_units: float = 0.0
    total_tokens: int = 0     # usage: prompt + completion tokens
    cached_tokens: int = 0    # usage: prompt tokens the prefix cache served
    prompt_tokens: int = 0
    # usage: set when streaming mode served it, (sink_tokens, window_tokens): each token attended
    # only those, not the whole text
    streaming: tuple[int, int] | None = None


def sampling_params(max_tokens: int | None = None, temperature: float | None = None, **extra):
    params = common_pb2.SamplingParams(**extra)
    if max_tokens is not None:
        params.max_tokens = max_tokens
    if temperature is not None:
        params.temperature = temperature
    return params


class RouterClient:
    def __init__(self, address: str, api_key: str | None = None, ca_file: str | None = None):
        """`api_key`: sent as `authorization: Bearer`; `ca_file`: TLS, trusting that PEM file."""
        self.channel = open_channel(address, ca_file)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.auth = [("authorization", f"Bearer {api_key}")] if api_key else []

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "RouterClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def stream(self, request: router_pb2.GenerateRequest, priority: str | None = None,
               tenant: str | None = None, slo_ms: int | None = None, context_mode: str | None = None):
        """The raw call: iterate it for chunks, cancel() it to stop. `context_mode`: auto, dense
        or streaming (x-context-mode)."""
        metadata = list(self.auth)
        if context_mode is not None:
            metadata.append((CONTEXT_MODE_HEADER, context_mode))
        if slo_ms is not None:
            metadata.append((SLO_HEADER, str(slo_ms)))
        if priority is not None:
            metadata.append((PRIORITY_HEADER, priority))
        if tenant is not None:
            metadata.append((TENANT_HEADER, tenant))
        return self.stub.Generate(request, metadata=metadata)

    async def generate(self, request: router_pb2.GenerateRequest, priority: str | None = None,
                       tenant: str | None = None, on_text=None, slo_ms: int | None = None,
                       context_mode: str | None = None) -> Answer:
        """Stream a whole answer; `on_text(delta)` sees the text as it arrives."""
        answer = Answer()
        started = time.perf_counter()
        async for chunk in self.stream(request, priority, tenant, slo_ms, context_mode):
            if chunk.token_ids and not answer.token_ids:
                answer.ttft_ms = (time.perf_counter() - started) * 1000
            answer.text += chunk.text
            answer.token_ids.extend(chunk.token_ids)
            answer.pool = chunk.pool
            if on_text and chunk.text:
                on_text(chunk.text)
            if chunk.finish_reason:
                answer.finish_reason = common_pb2.FinishReason.Name(chunk.finish_reason) \
                    .removeprefix("FINISH_REASON_").lower()
                answer.server_timings = chunk.timings
                answer.cost_units = chunk.cost_units
                answer.total_tokens = chunk.usage.prompt_tokens + chunk.usage.completion_tokens
                answer.cached_tokens = chunk.usage.cached_tokens
                answer.prompt_tokens = chunk.usage.prompt_tokens
                if chunk.usage.HasField("streaming"):
                    answer.streaming = (chunk.usage.streaming.sink_tokens, chunk.usage.streaming.window_tokens)
        answer.e2e_ms = (time.perf_counter() - started) * 1000
        return answer


def chat_request(prompt: str, sampling: common_pb2.SamplingParams | None = None) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="user", content=prompt)],
                                      sampling=sampling)
