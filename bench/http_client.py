"""A lean asyncio client for the router's OpenAI-compatible HTTP front, for the benchmarks.

One HTTP/1.0 request per completion (the server closes the connection at the end, so the body
needs no chunked decoding), streamed as Server-Sent Events with include_usage. It does what
`services/tools/client.RouterClient.generate` does for gRPC and costs about as little, so that a
benchmark comparing the two fronts measures the servers, not the client libraries (the official
`openai` client parses every chunk into pydantic models: a real cost on a 2-core machine that
also runs the services).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from services.common.errors import STATUS


class HttpError(Exception):
    """A refusal (4xx/5xx) or an error event mid-stream (status 200), in OpenAI's error shape."""

    def __init__(self, status: int, error: dict):
        super().__init__(f"HTTP {status}: {error.get('message', '')}")
        self.status, self.type = status, error.get("type", "")
        self.code, self.message = error.get("code") or "", error.get("message", "")

    @property
    def grpc_code(self) -> str:
        """The gRPC status the same failure has on the other front (services/common/errors.py),
        so reports count both fronts' failures alike."""
        for status in STATUS.values():
            if status.http_type == self.type and self.status in (status.http, 200):
                return status.grpc
        return f"HTTP_{self.status}"


@dataclass(slots=True)
class HttpAnswer:
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0         # from the final usage chunk
    cached_tokens: int = 0         # usage.prompt_tokens_details.cached_tokens: served by the prefix cache
    ttft_ms: float = 0.0           # request sent -> first text event
    e2e_ms: float = 0.0
    finish_reason: str = ""


async def complete(address: str, model: str, prompt: str, max_tokens: int, priority: str,
                   tenant: str = "", api_key: str = "", tls: bool = False, **extra) -> HttpAnswer:
    """Stream one /v1/completions request (greedy, `extra` merged into the body) to `address`
    (host:port), with `api_key` as a bearer token when given, over TLS when `tls`."""
    host, port = address.rsplit(":", 1)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, **extra}).encode()
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port), ssl=tls or None)
    try:
        writer.write(b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
                     b"host: " + address.encode() + b"\r\nx-priority: " + priority.encode() + b"\r\n"
                     + (b"authorization: Bearer " + api_key.encode() + b"\r\n" if api_key else b"")
                     + (b"x-tenant: " + tenant.encode() + b"\r\n" if tenant else b"") + b"content-length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        status = int((await reader.readline()).split()[1])
        while (await reader.readline()).strip():
            pass
        if status != 200:
            raise HttpError(status, json.loads(await reader.read()).get("error", {}))
        answer = HttpAnswer()
        async for line in reader:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                raise HttpError(200, event["error"])
            for choice in event["choices"]:
                if choice["text"] and not answer.text:
                    answer.ttft_ms = (time.perf_counter() - started) * 1000
                answer.text += choice["text"]
                answer.finish_reason = choice["finish_reason"] or answer.finish_reason
            if usage := event.get("usage"):
                answer.completion_tokens = usage["completion_tokens"]
                answer.prompt_tokens = usage.get("prompt_tokens", 0)
                answer.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        answer.e2e_ms = (time.perf_counter() - started) * 1000
        return answer
    finally:
        writer.close()
