"""Every value of a rich, valid OpenAI request body replaced in turn by a value of each JSON kind:
parse_openai (pure) takes the body or refuses it as INVALID naming a field, and never raises
anything else (which the HTTP front answers with a 500, and clients retry). Where the value was a
number a boolean is refused, and the other way round: JSON's kinds, not Python's True == 1 (so
`best_of: true` no longer passes as the neutral 1)."""
from __future__ import annotations

import copy
import json

import pytest

from services.common.errors import ErrorKind, ServiceError
from services.router.openai_api.request import CHAT, COMPLETION, parse_openai

PARAMETERS = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}}, "required": ["x"]}
TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": PARAMETERS}}]
MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
COMMON = {"model": "m", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["END"], "n": 1,
          "stream": True, "stream_options": {"include_usage": True}, "service_tier": "default", "user": "u",
          "top_k": 4, "ignore_eos": False, "stop_token_ids": [5], "cache_salt": "s",
          "presence_penalty": 0.5, "frequency_penalty": 0.0, "best_of": 1, "repetition_penalty": 1.1, "min_p": 0.05,
          "logit_bias": {"5": 1.5}, "min_tokens": 2}
BODIES = {
    "chat, a named tool": (CHAT, {**COMMON, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2,
                                  "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}},
                                  "parallel_tool_calls": False}),
    "chat, a JSON schema": (CHAT, {**COMMON, "messages": MESSAGES[:2], "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": PARAMETERS}}}),
    "completion": (COMPLETION, {**COMMON, "prompt": "Once", "logprobs": 2, "echo": False}),
}
KINDS = [None, True, False, 0, 1, -1, 2**40, 0.5, float("1e300"), "", "x", [], [1], ["x"], {}, {"a": 1}]


def paths(value, path=()):
    """Every position in a JSON value (the root excluded)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield path + (key,)
        yield from paths(inner, path + (key,))


def replaced(body: dict, path: tuple, value) -> dict:
    changed = copy.deepcopy(body)
    target = changed
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return changed


def get(body, path):
    for key in path:
        body = body[key]
    return body


@pytest.mark.parametrize("name", BODIES)
def test_each_body_is_valid_as_it_stands(name):
    kind, body = BODIES[name]
    parse_openai(kind, json.dumps(body).encode())


@pytest.mark.parametrize("name", BODIES)
def test_every_value_of_every_kind_is_taken_or_refused_by_name(name):
    kind, body = BODIES[name]
    crashes, taken = [], []
    for path in paths(body):
        original = get(body, path)
        for value in KINDS:
            try:
                parse_openai(kind, json.dumps(replaced(body, path, value)).encode())
            except ServiceError as error:
                assert error.kind is ErrorKind.INVALID and error.field, (path, value, error)
                continue
            except Exception as exc:            # noqa: BLE001 - what the test looks for
                crashes.append(f"{'.'.join(map(str, path))} = {value!r}: {type(exc).__name__}: {exc}")
                continue
            if isinstance(original, bool) != isinstance(value, bool) and (
                    isinstance(original, (int, float)) and isinstance(value, (int, float))):
                taken.append(f"{'.'.join(map(str, path))} = {value!r} (was {original!r})")
    assert not crashes, "\n".join(crashes)
    assert not taken, "a boolean taken for a number or the other way round:\n" + "\n".join(taken)
