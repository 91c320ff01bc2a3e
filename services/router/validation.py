"""Checks on a Generate request that need no tokenizer, each failing with a ServiceError of kind
INVALID whose message and `field` name what is wrong. Pure Python.

    request_headers(pairs, auth)    the headers below and authorization, each at most once
    parse_head(metadata)            x-priority, x-tenant, x-slo-ms, x-lora, x-stream-interval,
                                    x-context-mode -> RequestHead
    decode_request(raw, context)    the body, parsed with its bytes twin -> GenerateRequest
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from services.common.bad_words import check_bad_words
from services.common.chat_options import chat_render, options_set
from services.common.errors import invalid
from services.common.grammar import check_structured
from services.common.priority import (CONTEXT_MODE_HEADER, LORA_HEADER, PRIORITY_HEADER, SLO_HEADER,
                                      STREAM_INTERVAL_HEADER, TENANT_HEADER, Priority, parse_context_mode,
                                      parse_priority, parse_slo_ms, parse_stream_interval, parse_tenant)
from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.common.step import MAX_TOP_LOGPROBS, SamplingParams, guides_set
from services.common.wire import client_adjustments

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
# The scheduler holds back up to this much text per request while it could begin a stop string.
MAX_STOP_CHARS = 1024


@dataclass(slots=True, frozen=True)
class RequestHead:
    """What a front learns before reading the body: class, tenant, objective, adapter; and the
    id the router gives the request (the HTTP front returns it as X-Request-Id)."""
    priority: Priority
    tenant: str = ""
    slo_ms: int = 0                  # 0: none
    lora: str | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tenant_weight: float = 1.0       # the tenant's share inside its class (from its record)
    stream_interval: int = 0         # tokens per chunk after the first; 0: the pool's setting
    context_mode: int = common_pb2.CONTEXT_MODE_AUTO    # dense or streaming attention (qos.v1.ContextMode)
    choice: int = 0                  # of a request with n choices (services/router/openai_api/choices.py)
    prompt_only: bool = False        # an echo with max_tokens 0: its one computed token is dropped
    batch: bool = False              # a line of a batch (openai_api/batch_runner.py): not rate-limited

    @property
    def context_checked(self) -> bool:
        """Whether the router may refuse max_tokens past the model's context itself: only a dense
        request's; streaming (asked for, or the class's default) has no such bound."""
        return self.context_mode == common_pb2.CONTEXT_MODE_DENSE


# What both fronts read from a request's headers (gRPC metadata).
REQUEST_HEADERS = frozenset((PRIORITY_HEADER, TENANT_HEADER, SLO_HEADER, LORA_HEADER, STREAM_INTERVAL_HEADER,
                             CONTEXT_MODE_HEADER, "authorization"))


def request_headers(pairs: Iterable[tuple[str, str]], auth_required: bool = True) -> dict[str, str]:
    """Our headers among a request's (name, value) pairs, by lower-cased name. One sent twice
    with values that differ (beyond case and surrounding spaces) is INVALID naming it: HTTP took
    the first and gRPC the last, so `x-priority: high` and `x-priority: low` were served as one of
    them without a word. With auth off the key names nobody: a second authorization (a proxy's)
    is left alone, the first kept."""
    found: dict[str, str] = {}
    for name, value in pairs:
        name = name.lower()
        if name not in REQUEST_HEADERS:
            continue
        kept = found.setdefault(name, value)
        if kept is not value and _differ(name, kept, value) and (auth_required or name != "authorization"):
            raise invalid(f"{name} is sent twice with different values: send it once", field=name)
    return found


def _differ(name: str, first: str, second: str) -> bool:
    if name == "authorization":         # a key is compared exactly
        return first != second
    return first.strip().lower() != second.strip().lower()


def parse_head(metadata: Mapping[str, str]) -> RequestHead:
    """gRPC metadata (or HTTP headers, lower-cased) -> RequestHead."""
    return RequestHead(_header(metadata, PRIORITY_HEADER, parse_priority),
                       _header(metadata, TENANT_HEADER, parse_tenant),
                       _header(metadata, SLO_HEADER, parse_slo_ms), metadata.get(LORA_HEADER) or None,
                       stream_interval=_header(metadata, STREAM_INTERVAL_HEADER, parse_stream_interval),
                       context_mode=_header(metadata, CONTEXT_MODE_HEADER, parse_context_mode))


def _header(metadata: Mapping[str, str], header: str, parse):
    """`parse` of the header's value; its ValueError as INVALID naming the header."""
    try:
        return parse(metadata.get(header))
    except ValueError as exc:
        raise invalid(str(exc), field=header) from None


def _text(value: bytes, field: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"{field} is not valid UTF-8 (byte 0x{value[exc.start]:02x} at offset "
                      f"{exc.start})", field=field) from None


def check_sampling(s: common_pb2.SamplingParams, max_context: int | None) -> None:
    if s.HasField("max_tokens"):
        if s.max_tokens <= 0:
            raise invalid(f"sampling.max_tokens must be > 0, got {s.max_tokens}", "sampling.max_tokens")
        if max_context is not None and s.max_tokens >= max_context:
            raise invalid(f"sampling.max_tokens={s.max_tokens} exceeds the model's context window "
                          f"of {max_context} tokens (prompt included)", "sampling.max_tokens")
    if s.HasField("temperature") and not (s.temperature >= 0 and math.isfinite(s.temperature)):
        raise invalid(f"sampling.temperature must be a finite number >= 0, got {s.temperature}",
                      "sampling.temperature")
    if s.HasField("top_p") and not (0.0 < s.top_p <= 1.0):
        raise invalid(f"sampling.top_p must be in (0, 1], got {s.top_p}", "sampling.top_p")
    if s.HasField("top_k") and s.top_k < 0:
        raise invalid(f"sampling.top_k must be >= 0 (0 disables it), got {s.top_k}", "sampling.top_k")
    try:        # the bounds the engine's SamplingParams holds them to (services/common/step.py)
        # max_tokens as sent, or none yet: the scheduler holds min_tokens to the one it resolves.
        SamplingParams(**client_adjustments(s), max_tokens=s.max_tokens if s.max_tokens > 0 else 2**31 - 1)
    except ValueError as exc:
        raise invalid(f"sampling.{exc}", field=f"sampling.{str(exc).split()[0]}") from None
    for name in ("logprobs", "prompt_logprobs"):
        if s.HasField(name) and getattr(s, name) > MAX_TOP_LOGPROBS:
            raise invalid(f"sampling.{name} must be in 0..{MAX_TOP_LOGPROBS}, got {getattr(s, name)}", f"sampling.{name}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise invalid(f"sampling.stop has {len(s.stop)} strings, at most {MAX_STOP_STRINGS} are allowed",
                      "sampling.stop")
    for i, stop in enumerate(s.stop):
        if not stop:
            raise invalid(f"sampling.stop[{i}] is empty", f"sampling.stop[{i}]")
        if len(stop) > MAX_STOP_CHARS:
            raise invalid(f"sampling.stop[{i}] is {len(stop)} characters long, at most {MAX_STOP_CHARS} "
                          "are allowed", f"sampling.stop[{i}]")
    if s.allowed_token_ids and guides_set(s):
        raise invalid(f"sampling.allowed_token_ids and sampling.{guides_set(s)[0]} both say which tokens may come: "
                      "set one of them", "sampling.allowed_token_ids")
    check_bad_words(s)
    if s.HasField("truncate_prompt_tokens") and not (
            s.truncate_prompt_tokens == -1 or 1 <= s.truncate_prompt_tokens <= (max_context or 2**31 - 1)):
        raise invalid(f"sampling.truncate_prompt_tokens must be -1 (what leaves room for the answer) or a number of "
                      f"tokens from 1{f' to {max_context} (the context window)' if max_context else ''}, got "
                      f"{s.truncate_prompt_tokens}", "sampling.truncate_prompt_tokens")
    # The scheduler checks each id against its model's vocabulary; here, what any model refuses.
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"sampling.stop_token_ids has {len(s.stop_token_ids)} ids, at most {MAX_STOP_TOKEN_IDS} "
                      "are allowed", "sampling.stop_token_ids")
    for i, token_id in enumerate(s.stop_token_ids):
        if token_id < 0:
            raise invalid(f"sampling.stop_token_ids[{i}] must be a token id >= 0, got {token_id}",
                          f"sampling.stop_token_ids[{i}]")


def decode_request(raw: router_pb2.GenerateRequestBytes,
                   max_context: int | None) -> router_pb2.GenerateRequest:
    """Validate a request parsed with its bytes twin and return the typed request."""
    prompt = _text(raw.prompt, "prompt")
    messages = [common_pb2.ChatMessage(role=_text(m.role, f"messages[{i}].role"),
                                       content=_text(m.content, f"messages[{i}].content"))
                for i, m in enumerate(raw.messages)]
    if raw.tools or raw.tool_choice or any(m.tool_calls or m.tool_call_id for m in raw.messages):
        raise invalid("tools are served on the HTTP API (/v1/chat/completions); over gRPC, ask for a "
                      "function's arguments with sampling.json_schema", "tools")
    model = _text(raw.model, "model")
    if sum(map(bool, (prompt, messages, raw.prompt_token_ids))) > 1:
        raise invalid("set one of prompt, messages and prompt_token_ids", "prompt")
    if not messages and not prompt and not raw.prompt_token_ids:
        raise invalid("prompt is empty: set prompt, messages or prompt_token_ids", "prompt")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}",
                          f"messages[{i}].role")
    if messages and not any(m.content for m in messages):
        raise invalid("messages are all empty", "messages")
    check_sampling(raw.sampling, max_context)
    check_guides(raw.sampling)
    return router_pb2.GenerateRequest(prompt=prompt, messages=messages, sampling=raw.sampling,
                                      model=model, prompt_token_ids=raw.prompt_token_ids,
                                      cache_salt=check_cache_salt(_text(raw.cache_salt, "cache_salt")),
                                      chat_template=_chat_template(raw, bool(messages)))


def _chat_template(raw: router_pb2.GenerateRequestBytes, chat: bool) -> common_pb2.ChatTemplateOptions:
    """The chat template's options, decoded and checked; only with messages (a prompt has no template)."""
    options = raw.chat_template
    if not raw.HasField("chat_template"):
        return common_pb2.ChatTemplateOptions()
    typed = common_pb2.ChatTemplateOptions(continue_final_message=options.continue_final_message,
                                           kwargs_json=_text(options.kwargs_json, "chat_template.kwargs_json"))
    if options.HasField("add_generation_prompt"):
        typed.add_generation_prompt = options.add_generation_prompt
    if options_set(typed) and not chat:
        raise invalid("chat_template options apply to messages (rendered with the chat template), not to a prompt",
                      "chat_template")
    chat_render(typed)
    return typed


def check_guides(s: common_pb2.SamplingParams) -> None:
    """A structured output (json_schema, regex, choice or grammar: one at most), compiled here: one
    the workers could not use is refused at once."""
    guides = guides_set(s)
    if len(guides) > 1:
        raise invalid(f"sampling.{guides[1]} and sampling.{guides[0]} both say what the output is: set one "
                      "of them", f"sampling.{guides[1]}")
    check_structured(s)
    if guides and s.ignore_eos:
        raise invalid(f"sampling.ignore_eos cannot be combined with sampling.{guides[0]}: a structured "
                      "answer ends where it is complete", "sampling.ignore_eos")


MAX_CACHE_SALT = 256


def check_cache_salt(salt: str, field: str = "cache_salt") -> str:
    if len(salt) > MAX_CACHE_SALT:
        raise invalid(f"{field} is {len(salt)} characters long, at most {MAX_CACHE_SALT} are allowed", field)
    return salt
