"""A conversation with function calling, made ready for the model's chat template. Pure.

A template with a tool format (it renders a `tools` list: Qwen2.5, Llama 3.1, Hermes, ...) gets
the tools and the turns' calls as it expects them (arguments as objects). A template without one
(the embedded SmolLM2's) cannot serve tool_choice "auto": the model has no way to say whether it
calls, and the request is refused saying so. A forced call still works there: the functions are
described in a system turn and the answer is generated under their grammar (sampling.json_schema,
set by the router); earlier calls in the conversation are shown as the JSON the model would have
written.
"""
from __future__ import annotations

import json

from services.common.errors import invalid
from services.common.proto.qos.v1 import scheduler_pb2
from services.common.tokenizer import ChatTemplate


def chat_turns(submit: scheduler_pb2.SubmitRequest, template: ChatTemplate | None,
               model: str) -> tuple[list[dict], list | None]:
    """The messages for the template, and the tools to render with them (None: none, or described
    in the messages)."""
    native = template is not None and template.has_tool_format
    messages = [_turn(m, native, f"messages[{i}]") for i, m in enumerate(submit.messages)]
    if not submit.tools:
        return messages, None
    tools = _json_list(submit.tools, "tools", ("function", "name"), ("function", "parameters"))
    if native:
        return messages, tools
    if submit.tool_choice == "auto":
        raise invalid(f"model {model}'s chat template has no tool-call format, so it cannot choose whether "
                      'to call a function (tool_choice "auto"); send tool_choice "required", or '
                      '{"type": "function", "function": {"name": ...}} to call one', "tool_choice")
    described = describe(tools, submit.tool_choice)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{described}"}, *messages[1:]], None
    return [{"role": "system", "content": described}, *messages], None


def describe(tools: list, choice: str) -> str:
    """The system turn that tells a model without a tool format what to call, and how."""
    lines = ["You can call these functions:"]
    for tool in tools:
        function = tool["function"]
        lines.append(f"- {function['name']}: {function.get('description', '')}".rstrip(": "))
        lines.append(f"  parameters (JSON Schema): {json.dumps(function['parameters'], ensure_ascii=False)}")
    if choice == "required":
        lines.append('Answer with the calls to make, as a JSON array of {"name": ..., "arguments": {...}} objects.')
    else:
        lines.append(f"Call {choice}: answer with its arguments, as one JSON object.")
    return "\n".join(lines)


def _json_list(text: str, field: str, *paths: tuple[str, str]) -> list:
    """`text` as a JSON list of objects each holding every (outer, inner) key of `paths` (the
    router sends them so; a caller of the scheduler's own Submit may not): else INVALID_ARGUMENT
    naming `field`."""
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise invalid(f"{field} is not JSON: {exc}", field) from None
    if not isinstance(items, list) or not all(
            isinstance(item, dict) and isinstance(item.get(outer), dict) and inner in item[outer]
            for item in items for outer, inner in paths):
        keys = ", ".join(f"{outer}.{inner}" for outer, inner in paths)
        raise invalid(f"{field} must be a JSON list of objects with {keys}", field)
    return items


def _turn(message, native: bool, field: str) -> dict:
    turn = {"role": message.role, "content": message.content}
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = _json_list(message.tool_calls, f"{field}.tool_calls", ("function", "name"), ("function", "arguments"))
        if native:
            turn["tool_calls"] = [{**c, "function": {"name": c["function"]["name"],
                                                     "arguments": _arguments(c["function"]["arguments"])}}
                                  for c in calls]
        else:
            shown = json.dumps([{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                                for c in calls], ensure_ascii=False, separators=(", ", ": "))
            turn["content"] = f"{turn['content']}\n{shown}" if turn["content"] else shown
    return turn


def _arguments(text: str):
    """A call's arguments as an object where they are JSON text (as templates print them), else as sent."""
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text
