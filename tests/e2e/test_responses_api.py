"""OpenAI's Responses API (POST /v1/responses) through the official `openai` client on a real
cluster (embedded SmolLM2, fp32, greedy): each answer equals the chat completion of the same
conversation, whole or streamed event by event; structured output through `responses.parse`;
a function call and its output sent back as input; logprobs; what is not served refused by name."""
from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel, Field

from services.local.cluster import LocalCluster
from tests.e2e.conftest import cluster_config

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(cluster_config(dtype="fp32"), quiet=True) as running:
        yield running


def chat_answer(client, model, messages, max_tokens, **extra):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                          **extra)


def test_a_response_is_the_chat_answer_of_its_conversation(client, model):
    response = client.responses.create(model=model, instructions="Be brief.", input="Say hello.",
                                       max_output_tokens=16, temperature=0)
    chat = chat_answer(client, model, [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Say hello."}], 16)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    finished = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finished == "length" else "completed")
    if finished == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == "Be brief." and response.max_output_tokens == 16 and response.store is False


def test_a_stream_tells_the_same_answer_event_by_event(client, model):
    whole = client.responses.create(model=model, input="Name three colours.", max_output_tokens=400, temperature=0)
    assert whole.status == "completed"
    with client.responses.stream(model=model, input="Name three colours.", max_output_tokens=400,
                                 temperature=0) as stream:
        told = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in told]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in told] == list(range(len(told)))
    assert "".join(e.delta for e in told if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    cut = list(client.responses.create(model=model, input="Name three colours.", max_output_tokens=3,
                                       temperature=0, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


def test_parse_fills_a_pydantic_model(client, model):
    parsed = client.responses.parse(model=model, input="Name a city in France.", text_format=City,
                                    max_output_tokens=100, temperature=0)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


def test_a_function_call_and_its_output_go_back_as_input(client, model):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.responses.create(model=model, input=asked, tools=[WEATHER], max_output_tokens=60,
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert isinstance(call.arguments, str) and "city" in call.arguments
    answered = client.responses.create(
        model=model, input=[*asked, call, {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER], tool_choice="none", max_output_tokens=20, temperature=0)
    chat = chat_answer(client, model, [*asked, {"role": "assistant", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}], 20,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none")
    assert answered.output_text == chat.choices[0].message.content
    assert answered.usage.input_tokens == chat.usage.prompt_tokens


def test_logprobs_are_the_chat_endpoints(client, model):
    response = client.responses.create(model=model, input="Say hello.", max_output_tokens=8, temperature=0,
                                       include=["message.output_text.logprobs"], top_logprobs=2)
    chat = chat_answer(client, model, [{"role": "user", "content": "Say hello."}], 8, logprobs=True, top_logprobs=2)
    ours = response.output[0].content[0].logprobs
    theirs = chat.choices[0].logprobs.content
    assert [(e.token, len(e.top_logprobs)) for e in ours] == [(e.token, 2) for e in theirs]
    assert [e.logprob for e in ours] == pytest.approx([e.logprob for e in theirs], abs=1e-6)


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_x"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
])
def test_what_is_not_served_is_a_400_naming_it(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, **{"input": "Hi", **extra})
    assert refused.value.body["param"] == param
