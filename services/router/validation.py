"""Checks on a Generate request that need no tokenizer, each failing with a message that names the
field. Pure Python: raises InvalidRequest, the server maps it to INVALID_ARGUMENT."""
from __future__ import annotations

import math

from services.common.proto.qos.v1 import common_pb2, router_pb2

CHAT_ROLES = ("system", "user", "assistant", "tool")


class InvalidRequest(ValueError):
    pass


def _text(value: bytes, field: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{field} is not valid UTF-8 (byte 0x{value[exc.start]:02x} at offset "
                             f"{exc.start})") from None


def check_sampling(s: common_pb2.SamplingParams, max_context: int | None) -> None:
    if s.HasField("max_tokens"):
        if s.max_tokens <= 0:
            raise InvalidRequest(f"sampling.max_tokens must be > 0, got {s.max_tokens}")
        if max_context is not None and s.max_tokens >= max_context:
            raise InvalidRequest(f"sampling.max_tokens={s.max_tokens} exceeds the model's context "
                                 f"window of {max_context} tokens (prompt included)")
    if s.HasField("temperature") and not (s.temperature >= 0 and math.isfinite(s.temperature)):
        raise InvalidRequest(f"sampling.temperature must be a finite number >= 0, got {s.temperature}")
    if s.HasField("top_p") and not (0.0 < s.top_p <= 1.0):
        raise InvalidRequest(f"sampling.top_p must be in (0, 1], got {s.top_p}")
    if s.HasField("top_k") and s.top_k < 0:
        raise InvalidRequest(f"sampling.top_k must be >= 0 (0 disables it), got {s.top_k}")
    for i, stop in enumerate(s.stop):
        if not stop:
            raise InvalidRequest(f"sampling.stop[{i}] is empty")


def decode_request(raw: router_pb2.GenerateRequestBytes,
                   max_context: int | None) -> router_pb2.GenerateRequest:
    """Validate a request parsed with its bytes twin and return the typed request."""
    prompt = _text(raw.prompt, "prompt")
    messages = [common_pb2.ChatMessage(role=_text(m.role, f"messages[{i}].role"),
                                       content=_text(m.content, f"messages[{i}].content"))
                for i, m in enumerate(raw.messages)]
    model = _text(raw.model, "model")
    if prompt and messages:
        raise InvalidRequest("set either prompt or messages, not both")
    if not messages and not prompt:
        raise InvalidRequest("prompt is empty: set prompt or messages")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                 f"got {m.role!r}")
    if messages and not any(m.content for m in messages):
        raise InvalidRequest("messages are all empty")
    check_sampling(raw.sampling, max_context)
    return router_pb2.GenerateRequest(prompt=prompt, messages=messages, sampling=raw.sampling,
                                      model=model)
