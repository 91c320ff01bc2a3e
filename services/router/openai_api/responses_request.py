"""OpenAI's Responses API request (POST /v1/responses) -> our chat request. Pure.

A Responses body says what a chat completion says in other words: `input` (a string, or a list of
items: messages, the function calls of an earlier answer and their outputs) after `instructions`
(a system turn); `max_output_tokens`; `text.format` for a structured answer; function tools
flattened (`{"type": "function", "name", "parameters"}`). So it is rewritten as the chat body it
means and read by the chat parser (request.py): every check is the chat endpoint's, and an
error names the field as this body has it (`input[2].content[0].text`, `text.format.schema`).

`previous_response_id` continues a kept response (responses_kept.py reads it from the store): its
input items and its output come before this body's input, its instructions do not (OpenAI's
rule). Its own input items, each with an id, are what a kept response keeps as its input (the
store reads the earlier turns' along the chain).

`background: true` (with store) answers at once with the response queued and runs it after
(responses_background.py); `conversation` puts a conversation's items (conversations.py) before
the input. Refused by name, with the reason: `prompt` (stored prompt templates are OpenAI's), OpenAI's own tools (web search, file search, ...), inputs other than text,
reasoning items and settings.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

from services.common.errors import ServiceError, invalid
from services.common.responses_config import ResponsesConfig
from services.router.openai_api.json_fields import json_kind, text_field
from services.router.openai_api.request import CHAT, OpenAIRequest, json_object, parse_rewritten

RESPONSES = "responses"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Taken as the chat endpoint takes them (vLLM's Responses endpoint takes these sampling extras too).
PASSED = {"model", "temperature", "top_p", "stream", "user", "service_tier", "parallel_tool_calls",
          "prompt_cache_key", "safety_identifier", "top_k", "seed", "stop", "ignore_eos", "priority",
          "cache_salt", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "frequency_penalty",
          "presence_penalty", "context_mode"}
OWN = {"input", "instructions", "max_output_tokens", "text", "tools", "tool_choice", "metadata", "include",
       "top_logprobs", "store", "previous_response_id", "background", "conversation"}
# Fields at the values that ask for nothing we lack (null always does), and why others are refused.
NEUTRAL = {"truncation": (("disabled",), "an input over the context window is refused, not cut"),
           "reasoning": (({},), "the served models do not reason apart from their answer"),
           "max_tool_calls": ((), "the answer holds the calls the model makes"),
           "prompt": ((), "stored prompt templates are OpenAI's: send instructions and input"),
           "stream_options": (({},), "no option of a stream is served")}
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}
MAX_ID = 64


@dataclass(slots=True)
class ResponsesEcho:
    """What the response object repeats of the request, and where each chat message came from
    (for errors): `inputs[k]` is the `input` item (or "instructions") chat message k was made of."""
    fields: dict = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    items: list[dict] = field(default_factory=list)   # its own input items, as kept (not the earlier turns')
    previous_id: str | None = None
    store: bool = False                               # whether the answer is kept
    background: bool = False                          # run after the answer (queued), polled
    conversation_id: str | None = None                # a conversation its input and output join
    body: dict | None = None                          # the body as sent (a background one is run again from it)

    def param(self, chat_param: str | None) -> str | None:
        """A chat body's parameter as this Responses body named it."""
        if chat_param is None:
            return None
        if (m := re.match(r"messages\[(\d+)\](.*)", chat_param)) and int(m[1]) < len(self.inputs):
            return self.inputs[int(m[1])] + (m[2] if self.inputs[int(m[1])].startswith("input[") else "")
        for chat, ours in (("max_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
                           ("response_format", "text.format"), ("tool_choice.function", "tool_choice"),
                           ("logprobs", "include"), ("messages", "input")):
            if chat_param == chat or chat_param.startswith(chat + "."):
                return ours + chat_param[len(chat):]
        if m := re.match(r"tools\[(\d+)\]\.function(.*)", chat_param):
            return f"tools[{m[1]}]{m[2]}"
        return chat_param


def parse_responses(raw: bytes) -> OpenAIRequest:
    """A body on its own (a batch's line): nothing kept, no earlier response continued."""
    return parse_responses_body(json_object(raw))


def parse_responses_body(body: dict, previous: tuple[dict, list[dict]] | None = None,
                         keeping: ResponsesConfig | None = None,
                         conversation: tuple[str, list[dict]] | None = None) -> OpenAIRequest:
    """`previous`: the kept response `previous_response_id` names and its input items (the caller
    reads them); `keeping`: the settings when this request's answer may be kept, else None;
    `conversation`: the conversation `conversation` names (its id and items, read by the caller)."""
    echo = ResponsesEcho()
    chat = {name: body[name] for name in PASSED if body.get(name) is not None}
    for name, value in body.items():
        if value is None or name in PASSED or name in OWN:
            continue
        if name not in NEUTRAL:
            raise invalid(f"unknown field {name!r} for responses", name)
        values, why = NEUTRAL[name]
        if value not in values or type(value) is not type(values[0]):
            raise invalid(f"{name} is not supported by this server: {why}", name)
    _keeping(body, previous, keeping, echo)
    if conversation is not None:
        echo.conversation_id = conversation[0]
        previous = ({"output": conversation[1]}, [])        # its items come before the input, as kept turns'
    chat["messages"] = _messages(body, echo, previous, keeping.max_items if keeping else None)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    _text_format(body.get("text"), chat)
    _tools(body, chat)
    _logprobs(body, chat)
    if body.get("metadata") is not None:
        echo.fields["metadata"] = check_metadata(body["metadata"])
    request = parse_rewritten(CHAT, chat, echo)
    request.responses = echo
    echo.fields.update({name: body.get(name) for name in ("instructions", "max_output_tokens", "temperature",
                                                          "top_p", "user")})
    echo.fields.update(tools=body.get("tools") or [], tool_choice=body.get("tool_choice") or "auto",
                       parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
                       text=body.get("text") or {"format": {"type": "text"}})
    return request


def input_items(items) -> list[dict]:
    """Items checked as a Responses body's `input` list is, each with an id (a conversation's
    items as they are added); an error names them as `items[i]...`."""
    if not isinstance(items, list) or not items:
        raise invalid(f"items must be a non-empty list of items, got {json_kind(items)}", "items")
    echo = ResponsesEcho(store=True)
    try:
        _messages({"input": items}, echo, None, None)
    except ServiceError as error:
        if error.field and error.field.startswith("input"):
            named = "items" + error.field.removeprefix("input")
            error.message, error.field = error.message.replace(error.field, named), named
        raise
    return echo.items


def conversation_id(body: dict) -> str | None:
    """The conversation a body joins (a string, or {"id": ...}), checked before it is looked up."""
    value = body.get("conversation")
    if value is None:
        return None
    if isinstance(value, dict) and set(value) == {"id"}:
        value = value["id"]
    if not isinstance(value, str) or not value or len(value) > MAX_ID:
        raise invalid('conversation must be a conversation\'s id, or {"id": ...}', "conversation")
    return value


def previous_id(body: dict) -> str | None:
    """The kept response a body continues (None: none), checked before it is looked up."""
    value = body.get("previous_response_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_ID:
        raise invalid(f"previous_response_id must be a response's id (a string of 1 to {MAX_ID} characters)",
                      "previous_response_id")
    return value


def _keeping(body: dict, previous, keeping: ResponsesConfig | None, echo: ResponsesEcho) -> None:
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise invalid(f"store must be true or false, got {json_kind(store)}", "store")
    asked = [name for name in ("store", "previous_response_id", "conversation") if body.get(name)]
    if keeping is None and asked:
        field_name = asked[0]
        raise invalid(f"{field_name}: no response is kept for this request (this server's [responses] store is "
                      "off, or it is a batch's line): send the whole conversation as input, with store false",
                      field_name)
    echo.store = keeping is not None and store is not False
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise invalid(f"background must be true or false, got {json_kind(background)}", "background")
    if background:
        if not echo.store:
            raise invalid("background: a background response is polled from the store: it needs store true (and "
                          "this server's [responses] store on; a batch's lines run in the background already)",
                          "background")
        echo.background = True
    if previous is not None:
        echo.previous_id = previous[0]["id"]
    if body.get("previous_response_id") is not None and body.get("conversation") is not None:
        raise invalid("conversation and previous_response_id both say what came before: send one of them",
                      "conversation")


def _messages(body: dict, echo: ResponsesEcho, previous, max_items: int | None) -> list[dict]:
    messages = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": text_field(body["instructions"], "instructions")})
        echo.inputs.append("instructions")
    items = body.get("input")
    if items is None:
        raise invalid("input is required", "input")
    if isinstance(items, str):
        items, named = [{"type": "message", "role": "user", "content": items}], ["input"]
    elif not isinstance(items, list) or not items:
        raise invalid(f"input must be a string or a non-empty list of items, got {json_kind(items)}", "input")
    else:
        named = [f"input[{i}]" for i in range(len(items))]
    own = len(items)
    if previous is not None:
        carried = previous[1] + list(previous[0].get("output") or ())
        items, named = carried + items, ["previous_response_id"] * len(carried) + named
    if max_items is not None and len(items) > max_items:
        where = "previous_response_id" if previous else "input"
        raise invalid(f"{where}: the conversation holds {len(items)} input items; at most {max_items} are kept",
                      where)
    for item, where in zip(items, named):
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object (a message, a function call or its output)", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": text_field(item.get("call_id"), f"{where}.call_id", allow_empty=False), "type": "function",
                    "function": {"name": text_field(item.get("name"), f"{where}.name", allow_empty=False),
                                 "arguments": text_field(item.get("arguments"), f"{where}.arguments")}}
            if messages and messages[-1].get("tool_calls") and echo.inputs[-1] != "instructions":
                messages[-1]["tool_calls"].append(call)        # the calls of one answer: one turn
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": text_field(item.get("call_id"), f"{where}.call_id"),
                             "content": output if isinstance(output, str) else _text_parts(output, f"{where}.output")})
        else:
            raise invalid(f"{where}.type {kind!r} is not served: input items are messages, function_call and "
                          "function_call_output (no reasoning, images, files or OpenAI's tools here)", f"{where}.type")
        echo.inputs.append(where)
    if echo.store or echo.conversation_id:   # its own input, kept (the store reads earlier turns' along the chain)
        echo.items = [_kept(item) for item in items[len(items) - own:]]
    return messages


def _kept(item: dict) -> dict:
    """An input item as a kept response lists it: with an id, a message's content as parts."""
    kind, given = item.get("type", "message"), item.get("id")
    kept = {"id": given if isinstance(given, str) and 0 < len(given) <= MAX_ID else ID_PREFIX[kind] + secrets.token_hex(12),
            "type": kind,
            **{k: v for k, v in item.items() if k not in ("id", "type")}}
    if kind == "message" and isinstance(kept["content"], str):
        part = "output_text" if kept["role"] == "assistant" else "input_text"
        kept["content"] = [{"type": part, "text": kept["content"]}]
    return kept


def _message(item: dict, where: str) -> dict:
    extra = sorted(set(item) - {"type", "role", "content", "id", "status", "phase"})
    if extra:
        raise invalid(f"{where}.{extra[0]} is not a field of a message item", f"{where}.{extra[0]}")
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    content = item.get("content")
    return {"role": role, "content": content if isinstance(content, str) else _text_parts(content, f"{where}.content")}


def _text_parts(parts, where: str) -> str:
    if not isinstance(parts, list):
        raise invalid(f"{where} must be a string or a list of text parts, got {json_kind(parts)}", where)
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else json_kind(part)
            raise invalid(f"{where}[{j}] is {kind!r}: only text parts (input_text, output_text) are served",
                          f"{where}[{j}].type")
        texts.append(text_field(part.get("text"), f"{where}[{j}].text"))
    return "".join(texts)


def _text_format(text, chat: dict) -> None:
    if text is None:
        return
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise invalid('text must be an object with a "format"', "text")
    if text.get("verbosity") not in (None, "medium"):
        raise invalid("text.verbosity is not supported by this server (only \"medium\")", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    else:
        chat["response_format"] = fmt


def _tools(body: dict, chat: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools must be a list of function tools", "tools")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else json_kind(tool)
                raise invalid(f"tools[{i}] is {kind!r}: only function tools are served (OpenAI's own tools "
                              "run on OpenAI's servers)", f"tools[{i}].type")
            chat["tools"].append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"}:
            raise invalid('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                          "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice


def _logprobs(body: dict, chat: dict) -> None:
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or any(item != LOGPROBS_INCLUDE for item in include):
            raise invalid(f"include: only {LOGPROBS_INCLUDE!r} is served (no stored or encrypted content here)",
                          "include")
        if include:
            chat["logprobs"] = True
            chat["top_logprobs"] = body.get("top_logprobs") or 0
    elif body.get("top_logprobs"):
        raise invalid(f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]", "top_logprobs")


def check_metadata(value) -> dict:
    # OpenAI's bounds: 16 keys of up to 64 characters, string values of up to 512.
    if not isinstance(value, dict) or len(value) > 16 or any(
            not isinstance(k, str) or len(k) > 64 or not isinstance(v, str) or len(v) > 512 for k, v in value.items()):
        raise invalid("metadata must be an object of at most 16 string keys (64 characters) to strings "
                      "(512 characters)", "metadata")
    return value
