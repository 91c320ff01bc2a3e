"""OpenAI's function calling on /v1/chat/completions, request side: `tools`, `tool_choice`,
`parallel_tool_calls`, and the tool turns of a conversation. Pure.

    tool_choice "none"                 the tools are not called (the answer is text)
    tool_choice "auto" (the default    the model decides, in its chat template's tool format; a
    when tools are given)              template without one is refused by the scheduler (400)
    tool_choice "required"             at least one call (one with parallel_tool_calls false): the
                                       answer is generated under the grammar of a JSON array of
                                       {"name": ..., "arguments": ...}, one schema per function
    {"type": "function",               that function is called: its arguments are generated under
     "function": {"name": N}}          the grammar of its `parameters` schema

A forced call's grammar comes from the functions' parameters schemas, compiled here: one that
cannot be compiled is a 400 naming its part (`tools[1].function.parameters.properties.x`).
"""
from __future__ import annotations

import json

from services.common.errors import invalid
from services.common.grammar import ANY_OBJECT, check_schema
from services.router.openai_api.json_fields import name_field, text_field

CALL_FIELDS = {"id", "type", "function"}


def parse_tools(body: dict, request) -> None:
    """tools, tool_choice and parallel_tool_calls onto the request (an OpenAIRequest): the tools
    and the choice for the scheduler, `request.tool_mode` ("auto", "required" or "named") and
    `request.tool_name` for the answer's tool_calls, and a forced call's grammar."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools: send the functions the model may call", "tool_choice")
        return
    functions = _functions(tools)
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        name = _named(choice, functions)
        request.tool_mode, request.tool_name = "named", name
        request.body.sampling.json_schema = functions[name][1]
        request.schema_field = f"tools[{functions[name][0]}].function.parameters"
        request.body.tool_choice = name
    elif choice in ("auto", "required"):
        request.body.tool_choice = request.tool_mode = choice
        if choice == "required":
            request.body.sampling.json_schema = calls_schema(functions, parallel is not False)
            request.schema_field = "tools"
    elif choice != "none":
        raise invalid('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}', "tool_choice")
    if request.body.tool_choice:
        request.body.tools = json.dumps([{"type": "function", "function": spec} for spec in
                                         (json.loads(f[2]) for f in functions.values())])


def _functions(tools) -> dict[str, tuple[int, str, str]]:
    """name -> (index in tools, its parameters schema as compiled JSON text, its function as JSON)."""
    if not isinstance(tools, list) or len(tools) > 128:
        raise invalid("tools must be a list of at most 128 {\"type\": \"function\", \"function\": {...}}", "tools")
    functions = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
            raise invalid(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        spec = tool["function"]
        where += ".function"
        if not isinstance(spec, dict) or set(spec) - {"name", "description", "parameters", "strict"}:
            raise invalid(f"{where} must be an object of name, description, parameters and strict", where)
        name = name_field(spec.get("name"), f"{where}.name")
        if name in functions:
            raise invalid(f"{where}.name: two functions are called {name!r}", f"{where}.name")
        if spec.get("description") is not None:
            text_field(spec["description"], f"{where}.description")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise invalid(f"{where}.strict must be true or false", f"{where}.strict")
        if spec.get("parameters") is not None and (not isinstance(spec["parameters"], dict) or
                                                   spec["parameters"].get("type") != "object"):
            raise invalid(f'{where}.parameters must be a JSON Schema of "type": "object"', f"{where}.parameters")
        parameters = ANY_OBJECT if spec.get("parameters") is None else check_schema(
            spec["parameters"], f"{where}.parameters")
        kept = {"name": name, **({"description": spec["description"]} if spec.get("description") else {}),
                "parameters": json.loads(parameters)}
        functions[name] = (i, parameters, json.dumps(kept))
    return functions


def _named(choice: dict, functions: dict) -> str:
    function = choice.get("function")
    if choice.get("type") != "function" or set(choice) != {"type", "function"} or not isinstance(function, dict) \
            or set(function) != {"name"}:
        raise invalid('tool_choice must be {"type": "function", "function": {"name": ...}} to name a function',
                      "tool_choice")
    if not isinstance(function["name"], str):
        raise invalid(f"tool_choice.function.name must be a string, got {type(function['name']).__name__}",
                      "tool_choice.function.name")
    if function["name"] not in functions:
        raise invalid(f"tool_choice names function {function['name']!r}, which is not among tools "
                      f"({', '.join(functions)})", "tool_choice.function.name")
    return function["name"]


def calls_schema(functions: dict, parallel: bool) -> str:
    """The JSON Schema of "required": an array of calls, each {"name": one function's, "arguments":
    its parameters}, in that order (llguidance keeps the listed order)."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": json.loads(parameters)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, (_, parameters, _) in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema, separators=(",", ":"))


def tool_calls_text(value, where: str) -> str:
    """An assistant turn's `tool_calls` (a list of {id, type, function: {name, arguments}}), checked,
    as JSON text for the scheduler's chat template."""
    if not isinstance(value, list) or not value:
        raise invalid(f"{where} must be a non-empty list of calls", where)
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or set(call) - CALL_FIELDS or call.get("type", "function") != "function":
            raise invalid(f'{at} must be {{"id": ..., "type": "function", "function": {{"name", "arguments"}}}}', at)
        if set(function) != {"name", "arguments"}:
            raise invalid(f"{at}.function must have a name and arguments (a JSON string)", f"{at}.function")
        text_field(function["name"], f"{at}.function.name")
        text_field(function["arguments"], f"{at}.function.arguments")
        if call.get("id") is not None:
            text_field(call["id"], f"{at}.id")
        calls.append({"id": call.get("id") or f"call_{j}", "type": "function",
                      "function": {"name": function["name"], "arguments": function["arguments"]}})
    return json.dumps(calls)

