"""Function calling (pure parts): tools and tool_choice parsed and refused by name; a forced call's
grammar; its answer as tool_calls, whole or streamed in any split; the conversation's tool turns
for a template with a tool format and for one without (tool_choice "auto" refused)."""
from __future__ import annotations

import json

import pytest

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import MEDIUM
from services.common.proto.qos.v1 import common_pb2, scheduler_pb2
from services.common.tokenizer import ChatTemplate
from services.router.openai_api.request import CHAT, parse_openai
from services.router.openai_api.response import OpenAIResponse
from services.router.openai_api.tool_calls import TaggedCalls, ToolCalls
from services.scheduler.chat_tools import chat_turns

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                                 "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def chat(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
    return parse_openai(CHAT, json.dumps(body).encode())


def refused(**fields) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        chat(**fields)
    assert caught.value.kind is ErrorKind.INVALID
    return caught.value


def test_a_named_function_is_generated_under_its_parameters_schema():
    r = chat(tools=[WEATHER, SEARCH], tool_choice={"type": "function", "function": {"name": "search"}})
    assert (r.tool_mode, r.tool_name, r.body.tool_choice) == ("named", "search", "search")
    assert json.loads(r.body.sampling.json_schema) == SEARCH["function"]["parameters"]
    assert [t["function"]["name"] for t in json.loads(r.body.tools)] == ["get_weather", "search"]


def test_required_is_an_array_of_calls_one_schema_per_function():
    schema = json.loads(chat(tools=[WEATHER, SEARCH], tool_choice="required").body.sampling.json_schema)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "search"]
    single = json.loads(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).body.sampling.json_schema)
    assert single["maxItems"] == 1 and single["items"]["properties"]["arguments"] == WEATHER["function"]["parameters"]


def test_auto_and_none_ask_for_no_grammar():
    auto = chat(tools=[WEATHER])                          # auto: OpenAI's default with tools
    assert (auto.tool_mode, auto.body.tool_choice, auto.body.sampling.json_schema) == ("auto", "auto", "")
    none = chat(tools=[WEATHER], tool_choice="none")
    assert (none.body.tools, none.body.tool_choice) == ("", "")


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "format": "nope"}}}}}]},
     "tools[0].function.parameters.properties.x"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    # Not a string: a dict lookup with it raised TypeError, a 500 the client retried.
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": {"a": 1}}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "tool", "content": "21C"}]}, "messages[0].tool_call_id"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]}, "tools[0].function.description"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "\udfff"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}, "messages[0].tool_call_id"),
])
def test_bad_tool_fields_are_refused_naming_them(fields, param):
    assert refused(**fields).field == param


def test_tool_turns_in_the_history_are_taken():
    r = chat(messages=[{"role": "user", "content": "Weather?"},
                       {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                           "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
                       {"role": "tool", "tool_call_id": "c1", "content": "21C"}], tools=[WEATHER])
    assistant, tool = r.body.messages[1], r.body.messages[2]
    assert json.loads(assistant.tool_calls)[0]["function"]["name"] == "get_weather"
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "c1", "21C")


REQUIRED = '[{"name": "get_weather", "arguments": {"city": "Pa\\"ris]", "unit": "c"}}, {"name": "search", "arguments": {"query": "x"}}]'


@pytest.mark.parametrize("split", [1, 2, 5, 1000])
def test_required_calls_stream_as_openai_does_in_any_split(split):
    out = ToolCalls("required", "", "req1")
    deltas = [d for i in range(0, len(REQUIRED), split) for d in out.feed(REQUIRED[i:i + split])]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.calls] == \
        [(c["name"], c["arguments"]) for c in json.loads(REQUIRED)]
    headers = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]) for d in headers] == [(0, {"name": "get_weather", "arguments": ""}),
                                                              (1, {"name": "search", "arguments": ""})]
    for index, call in enumerate(out.calls):         # the pieces join into the arguments exactly
        assert "".join(d["function"]["arguments"] for d in deltas if d["index"] == index) == call["function"]["arguments"]
    assert len({c["id"] for c in out.calls}) == 2


def test_a_named_call_as_a_whole_body_and_as_a_stream():
    request = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = OpenAIResponse(request, "r1", 1, MEDIUM)
    for piece, finish in (('{"city": ', 0), ('"Paris", "unit": "c"}', common_pb2.FINISH_REASON_STOP)):
        whole.add(0, common_pb2.GenerateChunk(text=piece, token_ids=[1], finish_reason=finish))
    choice = whole.body()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "c"}'}
    streamed = OpenAIResponse(request, "r1", 1, MEDIUM)
    events = streamed.events(0, common_pb2.GenerateChunk(text='{"city": ', token_ids=[1])) + streamed.events(
        0, common_pb2.GenerateChunk(text='"Paris", "unit": "c"}', token_ids=[2], finish_reason=common_pb2.FINISH_REASON_STOP))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": None}
    assert deltas[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][-1]["function"]["arguments"] for d in deltas[1:3]) == '{"city": "Paris", "unit": "c"}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_required_call_cut_before_its_name_ends_keeps_its_text_as_content():
    """max_tokens ran out inside the first call's name: the answer came back as content null and
    tool_calls [], the generated text nowhere (streamed: a role delta, then the finish)."""
    request = chat(tools=[WEATHER], tool_choice="required")
    cut = '[{"name": "get_w'
    whole = OpenAIResponse(request, "r1", 1, MEDIUM)
    whole.add(0, common_pb2.GenerateChunk(text=cut, token_ids=[1, 2, 3], finish_reason=common_pb2.FINISH_REASON_LENGTH))
    choice = whole.body()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": cut} and choice["finish_reason"] == "length"
    streamed = OpenAIResponse(request, "r1", 1, MEDIUM)
    events = streamed.events(0, common_pb2.GenerateChunk(text=cut[:5], token_ids=[1])) + streamed.events(
        0, common_pb2.GenerateChunk(text=cut[5:], token_ids=[2], finish_reason=common_pb2.FINISH_REASON_LENGTH))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == cut and not any("tool_calls" in d for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # Cut after a call began: that call, its arguments as far as they came.
    later = OpenAIResponse(request, "r1", 1, MEDIUM)
    later.add(0, common_pb2.GenerateChunk(text='[{"name": "get_weather", "arguments": {"ci', token_ids=[1],
                                       finish_reason=common_pb2.FINISH_REASON_LENGTH))
    message = later.body()["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == '{"ci'


PLAIN = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", None, None)
WITH_TOOLS = ChatTemplate("{% if tools %}TOOLS:{{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
                          "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                          "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.city }}]"
                          "{% endfor %}{% endfor %}", None, None)


def submit(choice: str, *messages) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(messages=messages or [common_pb2.ChatMessage(role="user", content="Hi")],
                                       tools=json.dumps([WEATHER]), tool_choice=choice)


def test_a_template_without_a_tool_format_refuses_auto_and_describes_forced_calls():
    with pytest.raises(ServiceError) as caught:
        chat_turns(submit("auto"), PLAIN, "SmolLM2")
    assert caught.value.field == "tool_choice" and "no tool-call format" in caught.value.message
    messages, tools = chat_turns(submit("get_weather"), PLAIN, "SmolLM2")
    assert tools is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    call = common_pb2.ChatMessage(role="assistant", tool_calls=json.dumps([{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]))
    messages, _ = chat_turns(submit("required", common_pb2.ChatMessage(role="user", content="Hi"), call), PLAIN, "m")
    assert json.loads(messages[-1]["content"]) == [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]


def test_a_template_with_a_tool_format_renders_the_tools_and_calls_itself():
    call = common_pb2.ChatMessage(role="assistant", tool_calls=json.dumps([{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]))
    messages, tools = chat_turns(submit("auto", common_pb2.ChatMessage(role="user", content="Hi"), call), WITH_TOOLS, "m")
    assert WITH_TOOLS.render(messages, add_generation_prompt=False, tools=tools) == \
        "TOOLS:get_weather<user>Hi<assistant>[get_weather Paris]"


TAGGED = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "x <y>"}}\n</tool_call>')


@pytest.mark.parametrize("split", [1, 3, 1000])
def test_auto_reads_the_calls_a_model_with_a_tool_format_writes(split):
    tagged = TaggedCalls("r9")
    content, deltas = "", []
    for i in range(0, len(TAGGED), split):
        piece, calls = tagged.feed(TAGGED[i:i + split])
        content, deltas = content + piece, deltas + calls
    piece, calls = tagged.feed("", final=True)
    content, deltas = content + piece, deltas + calls
    assert content.strip() == "Let me check." and "<tool" not in content
    assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == [
        (0, "get_weather", {"city": "Paris", "unit": "c"}), (1, "search", {"query": "x <y>"})]


def test_auto_text_that_only_looks_like_a_call_stays_text():
    tagged = TaggedCalls("r")
    assert tagged.feed("a <tool_ca") == ("a ", [])                  # held: it may begin a tag
    assert tagged.feed("ll> not json </tool_call> b") == ("<tool_call> not json </tool_call> b", [])
    assert tagged.feed("x <tool", final=True) == ("x <tool", []) and not tagged.calls


def test_an_auto_answer_with_calls_has_them_as_tool_calls():
    out = OpenAIResponse(chat(tools=[WEATHER]), "r1", 1, MEDIUM)
    out.add(0, common_pb2.GenerateChunk(text=TAGGED, token_ids=[1], finish_reason=common_pb2.FINISH_REASON_STOP))
    choice = out.body()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "search"]
    plain = OpenAIResponse(chat(tools=[WEATHER]), "r2", 1, MEDIUM)
    plain.add(0, common_pb2.GenerateChunk(text="It is sunny.", token_ids=[1], finish_reason=common_pb2.FINISH_REASON_STOP))
    assert plain.body()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert plain.body()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("tools, calls, field", [
    ("0", "", "tools"),
    ("[1]", "", "tools"),
    ('[{"function": {"name": "f"}}]', "", "tools"),                        # no parameters
    ("", "0", "messages[1].tool_calls"),                                   # the fuzzer's case
    ("", "not json", "messages[1].tool_calls"),
    ("", '[{"function": {"name": "f"}}]', "messages[1].tool_calls"),        # no arguments
    ("", '{"function": {"name": "f", "arguments": "{}"}}', "messages[1].tool_calls"),   # not a list
])
def test_malformed_tools_or_calls_sent_to_the_scheduler_itself_are_refused_by_field(tools, calls, field):
    """The router sends well-formed JSON; a caller of Scheduler.Submit may not: a precise refusal,
    never an exception (found by tests/e2e/test_fuzz_grpc.py)."""
    request = scheduler_pb2.SubmitRequest(
        messages=[common_pb2.ChatMessage(role="user", content="Hi"),
                  common_pb2.ChatMessage(role="assistant", tool_calls=calls)],
        tools=tools, tool_choice="required" if tools else "")
    for template in (PLAIN, WITH_TOOLS):
        with pytest.raises(ServiceError) as caught:
            chat_turns(request, template, "m")
        assert caught.value.kind is ErrorKind.INVALID and caught.value.field == field


def test_arguments_that_are_not_text_are_shown_as_sent():
    call = common_pb2.ChatMessage(role="assistant", tool_calls='[{"function": {"name": "f", "arguments": 1}}]')
    messages, _ = chat_turns(scheduler_pb2.SubmitRequest(messages=[call]), WITH_TOOLS, "m")
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == 1
