"""OpenAI's Responses API on the HTTP front: a body read as the chat request it means
(services/router/openai_api/responses_request.py), refused by name where it asks for what is not served,
and our chunks told as a `response` object or its typed event stream
(services/router/openai_api/responses_output.py)."""
from __future__ import annotations

import json

import pytest

from services.common.errors import ServiceError, invalid
from services.common.proto.qos.v1 import common_pb2
from services.router.openai_api.generation import http_param
from services.router.openai_api.responses_output import ResponsesAnswer
from services.router.openai_api.responses_request import parse_responses

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def parse(**body):
    return parse_responses(json.dumps({"model": "m", "input": "Hi", **body}).encode())


def refused(**body) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        parse(**body)
    return caught.value


def test_instructions_and_input_become_the_conversation():
    request = parse(instructions="Be brief.", max_output_tokens=40, temperature=0)
    assert [(m.role, m.content) for m in request.body.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert request.body.sampling.max_tokens == 40 and request.body.sampling.temperature == 0
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "Rules. "},
                                               {"type": "input_text", "text": "More."}]},
             {"role": "user", "content": "Weather in Paris and Rome?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}',
              "id": "fc_1", "status": "completed"},
             {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Sunny and rain.", "annotations": []}]}]
    messages = parse(input=items, tools=[WEATHER], tool_choice="none").body.messages
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert messages[0].content == "Rules. More." and messages[5].content == "Sunny and rain."
    calls = json.loads(messages[2].tool_calls)       # one answer's two calls: one turn
    assert [(c["id"], c["function"]["arguments"]) for c in calls] == [("c1", '{"city": "Paris"}'),
                                                                      ("c2", '{"city": "Rome"}')]
    assert (messages[3].tool_call_id, messages[4].content) == ("c1", "rain")


def test_formats_tools_and_logprobs_take_the_chat_paths():
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    shaped = parse(text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert json.loads(shaped.body.sampling.json_schema)["required"] == ["name"]
    assert parse(text={"format": {"type": "json_object"}}).body.sampling.json_schema
    named = parse(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert named.tool_mode == "named" and named.tool_name == "get_weather"
    assert json.loads(named.body.tools)[0]["function"]["name"] == "get_weather"
    logged = parse(include=["message.output_text.logprobs"], top_logprobs=3)
    assert logged.body.sampling.logprobs == 3
    echo = parse(metadata={"run": "7"}, user="u1", instructions="x").responses.fields
    assert echo["metadata"] == {"run": "7"} and echo["user"] == "u1" and echo["instructions"] == "x"
    assert parse(store=False, truncation="disabled", background=False, reasoning={}).body.messages


@pytest.mark.parametrize("body, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "x"}, {"role": "user", "content": 5}]}, "input[1].content"),
    ({"instructions": 5}, "instructions"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**WEATHER, "parameters": []}], "tool_choice": "required"}, "tools[0].parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {
        "age": {"type": "string", "pattern": "(("}}}}}}, "text.format.schema.properties.age"),
    ({"metadata": {"k": 5}}, "metadata"),
])
def test_what_is_not_served_is_refused_by_its_name(body, param):
    assert refused(**body).field == param


def test_the_schedulers_errors_name_the_responses_fields():
    request = parse(instructions="x", input=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                    tools=[WEATHER], tool_choice="none")
    assert http_param("sampling.max_tokens", request) == "max_output_tokens"
    assert http_param("prompt", request) == "input"               # the template refused the conversation
    assert request.responses.param("messages[2].content") == "input[1].content"
    assert request.responses.param("messages[0].content") == "instructions"
    assert http_param("sampling.temperature", request) == "temperature"


def chunk(text: str = "", ids=(), finish: int = 0, prompt: int = 5, completion: int = 0, logprobs=()):
    c = common_pb2.GenerateChunk(text=text, token_ids=list(ids), finish_reason=finish, logprobs=list(logprobs))
    c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.cached_tokens = prompt, completion, 2
    return c


STORY = [chunk("Once", [1]), chunk(" upon", [2]), chunk(" a time.", [3, 4], common_pb2.FINISH_REASON_STOP, completion=4)]


def events(answer: ResponsesAnswer, chunks) -> list[dict]:
    frames = b"".join(answer.frames(0, c) for c in chunks) + answer.end()
    out = []
    for block in frames.decode().split("\n\n")[:-1]:
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def test_a_whole_answer_is_a_response_object():
    answer = ResponsesAnswer(parse(instructions="Tell.", max_output_tokens=4), "r1", 100, 2)
    for c in STORY:
        answer.add(0, c)
    body = answer.body()
    assert (body["id"], body["object"], body["status"], body["incomplete_details"]) == ("resp_r1", "response",
                                                                                         "completed", None)
    assert body["output"] == [{"id": "msg_r1", "type": "message", "status": "completed", "role": "assistant",
                               "content": [{"type": "output_text", "text": "Once upon a time.", "annotations": []}]}]
    assert body["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 4,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 9}
    assert (body["instructions"], body["max_output_tokens"], body["store"]) == ("Tell.", 4, False)
    cut = ResponsesAnswer(parse(), "r2", 100, 2)
    cut.add(0, chunk("Once", [1], common_pb2.FINISH_REASON_LENGTH, completion=1))
    assert cut.body()["status"] == "incomplete" and cut.body()["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_forced_call_is_a_function_call_item():
    answer = ResponsesAnswer(parse(tools=[WEATHER], tool_choice="required"), "r3", 100, 2)
    answer.add(0, chunk('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', [1],
                        common_pb2.FINISH_REASON_STOP, completion=1))
    [item] = answer.body()["output"]
    assert (item["type"], item["name"], json.loads(item["arguments"])) == ("function_call", "get_weather",
                                                                          {"city": "Paris"})
    assert item["call_id"] and item["status"] == "completed"


def test_a_stream_tells_the_answer_event_by_event():
    answer = ResponsesAnswer(parse(include=["message.output_text.logprobs"]), "r4", 100, 2)
    told = events(answer, [chunk("Once", [1], logprobs=[common_pb2.TokenLogprob(token_id=1, logprob=-0.5,
                                                                                   token_bytes=b"Once")]),
                           *STORY[1:]])
    assert [e["sequence_number"] for e in told] == list(range(len(told)))
    assert [e["type"] for e in told[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                             "response.content_part.added"]
    assert told[0]["response"]["output"] == [] and told[0]["response"]["status"] == "in_progress"
    deltas = [e for e in told if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in deltas) == "Once upon a time."
    assert deltas[0]["logprobs"][0]["token"] == "Once" and deltas[1]["logprobs"] == []
    assert [e["type"] for e in told[-4:]] == ["response.output_text.done", "response.content_part.done",
                                              "response.output_item.done", "response.completed"]
    final = told[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Once upon a time." and final["usage"]["output_tokens"] == 4
    cut = ResponsesAnswer(parse(), "r5", 100, 2)
    assert events(cut, [chunk("Once", [1], common_pb2.FINISH_REASON_LENGTH, completion=1)])[-1]["type"] \
        == "response.incomplete"


def test_a_streamed_call_and_a_failure_after_the_first_event():
    answer = ResponsesAnswer(parse(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}),
                             "r6", 100, 2)
    told = events(answer, [chunk('{"city": ', [1]), chunk('"Paris"}', [2], common_pb2.FINISH_REASON_STOP, completion=2)])
    added = [e for e in told if e["type"] == "response.output_item.added"]
    assert len(added) == 1 and added[0]["item"]["type"] == "function_call"
    done = next(e for e in told if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"]) == {"city": "Paris"} and done["name"] == "get_weather"
    failing = ResponsesAnswer(parse(), "r7", 100, 2)
    first = failing.frames(0, chunk("Once", [1]))
    tail = failing.failed(invalid("boom", "temperature"), "temperature").decode().split("\n\n")[:-1]
    kinds = [json.loads(b.split("\n")[1].removeprefix("data: ")) for b in tail]
    assert first and [k["type"] for k in kinds] == ["error", "response.failed"]
    assert kinds[0]["param"] == "temperature" and kinds[1]["response"]["status"] == "failed"
    assert kinds[1]["response"]["error"]["message"] == "boom"
