"""OpenAI's Responses API (POST /v1/responses) through the official `openai` client on a real
cluster of two router replicas (embedded SmolLM2, fp32, greedy): each answer equals the chat
completion of the same conversation, whole or streamed event by event; structured output through
`responses.parse`; a function call and its output sent back as input; logprobs; kept answers read
back, listed, deleted and continued with previous_response_id on the other replica, each
tenant's alone; a conversation read and joined by its responses; background responses polled to
their end, streamed and resumed on the other replica after the connection dropped, cancelled from
the other replica, and failed when the router running one is killed; what is not served refused
by name."""
from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest
from pydantic import BaseModel, Field

from services.local.cluster import LocalCluster
from tests.e2e.conftest import cluster_config

pytestmark = pytest.mark.slow

ADMIN = "admin-key-for-responses-tests"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def cluster():
    config = cluster_config(dtype="fp32")
    config.auth.replicas = 2
    config.responses.background_lease_s = 1.5        # a lost router's background responses fail within it
    config.auth.admin_key = ADMIN                     # to read a request's ledger row (auth off: the admin's)
    config.billing.flush_seconds = 0.2
    with LocalCluster(config, quiet=True) as running:
        yield running


def tenant_client(cluster, tenant: str, replica: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.router_http_addresses[replica]}/v1", api_key="unused",
                         max_retries=0, timeout=120, default_headers={"x-tenant": tenant})


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
    assert response.instructions == "Be brief." and response.max_output_tokens == 16 and response.store is True


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
    ({"store": "yes"}, "store"),
    ({"previous_response_id": 7}, "previous_response_id"),
    ({"conversation": 7}, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
])
def test_what_is_not_served_is_a_400_naming_it(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, **{"input": "Hi", **extra})
    assert refused.value.body["param"] == param


def test_a_kept_response_is_read_back_and_continued_on_the_other_replica(cluster, model):
    with tenant_client(cluster, "alpha", 0) as first, tenant_client(cluster, "alpha", 1) as second:
        opened = first.responses.create(model=model, instructions="Be brief.", input="Name a fruit.",
                                        max_output_tokens=12, temperature=0)
        assert opened.store is True and second.responses.retrieve(opened.id).model_dump() == opened.model_dump()
        went_on = second.responses.create(model=model, previous_response_id=opened.id, instructions="Be brief.",
                                          input="And a colour?", max_output_tokens=12, temperature=0)
        # its instructions, then the earlier turns (their instructions not carried), then its input
        chat = chat_answer(second, model, [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Name a fruit."},
                                           {"role": "assistant", "content": opened.output_text},
                                           {"role": "user", "content": "And a colour?"}], 12)
        assert went_on.previous_response_id == opened.id
        # the same instructions: the earlier turn's prompt was computed already, the prefix cache serves it
        assert went_on.usage.input_tokens_details.cached_tokens >= 16
        no_instructions = second.responses.create(model=model, previous_response_id=opened.id,
                                                      input="And a colour?", max_output_tokens=1, temperature=0)
        without = chat_answer(second, model, [{"role": "user", "content": "Name a fruit."},
                                              {"role": "assistant", "content": opened.output_text},
                                              {"role": "user", "content": "And a colour?"}], 1)
        assert no_instructions.instructions is None                  # the earlier ones are not carried
        assert no_instructions.usage.input_tokens == without.usage.prompt_tokens
        assert went_on.output_text == chat.choices[0].message.content
        assert went_on.usage.input_tokens == chat.usage.prompt_tokens
        listed = list(first.responses.input_items.list(went_on.id))            # newest first, paged by the client
        assert [(i.type, i.role) for i in listed] == [("message", "user"), ("message", "assistant"),
                                                      ("message", "user")]
        assert listed[0].content[0].text == "And a colour?" and listed[1].id == opened.output[0].id
        oldest = first.responses.input_items.list(went_on.id, order="asc", limit=1)
        assert oldest.data[0].content[0].text == "Name a fruit." and oldest.has_more
        after = first.responses.input_items.list(went_on.id, order="asc", limit=5, after=oldest.data[0].id)
        assert [i.id for i in after.data] == [i.id for i in listed[1::-1]] and not after.has_more


def test_a_streamed_response_is_kept_before_its_last_event(cluster, model):
    with tenant_client(cluster, "alpha") as client:
        with client.responses.stream(model=model, input="Count to three.", max_output_tokens=400,
                                     temperature=0) as stream:
            final = stream.get_final_response()
        assert client.responses.retrieve(final.id).output_text == final.output_text
        went_on = client.responses.create(model=model, previous_response_id=final.id, input="Again.",
                                          max_output_tokens=4, temperature=0)
        assert went_on.usage.input_tokens > final.usage.input_tokens + final.usage.output_tokens


def test_deleted_unkept_and_other_tenants_responses_are_not_found(cluster, model):
    with tenant_client(cluster, "alpha") as alpha, tenant_client(cluster, "beta", 1) as beta:
        mine = alpha.responses.create(model=model, input="Hi", max_output_tokens=2, temperature=0)
        for attempt in (lambda: beta.responses.retrieve(mine.id), lambda: beta.responses.delete(mine.id),
                        lambda: beta.responses.input_items.list(mine.id),
                        lambda: beta.responses.create(model=model, input="Hi", previous_response_id=mine.id)):
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert alpha.responses.retrieve(mine.id).id == mine.id               # beta's delete took nothing
        with pytest.raises(openai.BadRequestError) as refused:
            alpha.responses.cancel(mine.id)
        assert "background" in refused.value.body["message"]
        alpha.responses.delete(mine.id)
        unkept = alpha.responses.create(model=model, input="Hi", max_output_tokens=2, temperature=0, store=False)
        assert unkept.store is False
        for gone in (mine.id, unkept.id):
            with pytest.raises(openai.NotFoundError):
                alpha.responses.retrieve(gone)
            with pytest.raises(openai.NotFoundError) as missing:
                alpha.responses.create(model=model, input="Hi", previous_response_id=gone)
            assert missing.value.body["param"] == "previous_response_id"


def polled(client, response_id: str, until=("completed", "incomplete", "failed", "cancelled"), timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = client.responses.retrieve(response_id)
        if response.status in until:
            return response
        time.sleep(0.2)
    raise AssertionError(f"{response_id} still {response.status} after {timeout} s")


def request_status(cluster, replica: int, request_id: str) -> dict:
    """GET /v1/requests/ID: in flight, or its ledger row (once the ledger's writer has written it)."""
    url = f"http://{cluster.router_http_addresses[replica]}/v1/requests/{request_id}"
    for _ in range(50):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers={"authorization": f"Bearer {ADMIN}"}),
                                        timeout=30) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise
            time.sleep(0.2)
    raise AssertionError(f"request {request_id} is neither in flight nor in the ledger")


LONG = {"max_output_tokens": 2000, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_a_background_response_is_polled_to_the_foreground_answer(cluster, model):
    with tenant_client(cluster, "alpha") as client:
        started = client.responses.create(model=model, input="Name three colours.", max_output_tokens=24,
                                          temperature=0, background=True)
        assert started.background is True and started.status in ("queued", "in_progress") and not started.output
        done = polled(client, started.id)
        alone = client.responses.create(model=model, input="Name three colours.", max_output_tokens=24, temperature=0)
        assert done.background is True and done.output_text == alone.output_text
        assert done.usage.output_tokens == alone.usage.output_tokens
        went_on = client.responses.create(model=model, previous_response_id=done.id, input="Thanks.",
                                          max_output_tokens=2, temperature=0)
        assert went_on.usage.input_tokens > alone.usage.input_tokens + alone.usage.output_tokens
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=model, input="Hi", background=True, store=False)
        assert refused.value.body["param"] == "background"


def test_a_background_stream_dropped_midway_resumes_on_the_other_replica(cluster, model):
    """OpenAI's background streaming: the POST's stream read to a point and dropped, the rest read
    with retrieve(stream=True, starting_after=N) on the other replica: together one stream
    (sequence numbers 0..n, none missing or repeated), whose deltas are the kept response's text
    and the foreground answer's."""
    ask = {"model": model, "input": "Name three colours.", "max_output_tokens": 24, "temperature": 0}
    with tenant_client(cluster, "alpha", 0) as first, tenant_client(cluster, "alpha", 1) as second:
        stream = first.responses.create(**ask, background=True, stream=True)
        seen = []
        for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) >= 6:
                break
        stream.close()                     # the client's connection drops; the response runs on
        response_id = seen[0].response.id
        assert seen[0].type == "response.created" and seen[0].response.status == "queued"
        rest = list(second.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
        events = seen + rest
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type in ("response.completed", "response.incomplete")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        alone = first.responses.create(**ask)
        assert text == events[-1].response.output_text == second.responses.retrieve(response_id).output_text \
            == alone.output_text
        again = list(first.responses.retrieve(response_id, stream=True))        # from its start, on the first
        assert [(e.sequence_number, e.type) for e in again] == [(e.sequence_number, e.type) for e in events]
        with pytest.raises(openai.BadRequestError) as refused:              # not made with stream: no events
            second.responses.retrieve(alone.id, stream=True)
        assert refused.value.body["param"] == "stream"
        url = f"http://{cluster.router_http_addresses[1]}/v1/responses/{response_id}?stream="
        bad_after = ("-1", "%C2%B2", "1e3")          # negative, a superscript two, a float
        for query, param in (*((f"true&starting_after={v}", "starting_after") for v in bad_after), ("maybe", "stream")):
            with pytest.raises(urllib.error.HTTPError) as bad:
                urllib.request.urlopen(urllib.request.Request(url + query, headers={"x-tenant": "alpha"}), timeout=30)
            assert bad.value.code == 400 and json.loads(bad.value.read())["error"]["param"] == param, query


def test_a_background_response_cancelled_on_the_other_replica_stops(cluster, model):
    with tenant_client(cluster, "alpha", 0) as runner, tenant_client(cluster, "alpha", 1) as other:
        started = runner.responses.create(model=model, input="Tell a long story.", background=True, **LONG)
        polled(runner, started.id, until=("in_progress",))
        with pytest.raises(openai.ConflictError) as early:      # not ended: nothing to continue yet
            other.responses.create(model=model, input="Hi", previous_response_id=started.id)
        assert early.value.body["param"] == "previous_response_id"
        cancelled = other.responses.cancel(started.id)
        assert cancelled.status == "cancelled" and other.responses.cancel(started.id).status == "cancelled"
        request_id = started.id.removeprefix("resp_")
        deadline = time.monotonic() + 30
        while request_status(cluster, 0, request_id)["status"] == "in_flight":      # seen at its lease renewal
            assert time.monotonic() < deadline, "the cancelled run went on"
            time.sleep(0.1)
        row = request_status(cluster, 0, request_id)
        assert row["status"] == "cancelled" and row["completion_tokens"] < 2000
        assert runner.responses.retrieve(started.id).status == "cancelled"


def test_a_conversation_is_read_and_joined_by_its_responses(cluster, model):
    with tenant_client(cluster, "alpha", 0) as alpha, tenant_client(cluster, "beta", 1) as beta:
        talk = alpha.conversations.create(items=[{"type": "message", "role": "user", "content": "My cat is Tom."}],
                                          metadata={"topic": "pets"})
        assert talk.id.startswith("conv_") and talk.metadata == {"topic": "pets"}
        first = alpha.responses.create(model=model, conversation=talk.id, input="Name my cat.", max_output_tokens=12,
                                       temperature=0)
        chat = chat_answer(alpha, model, [{"role": "user", "content": "My cat is Tom."},
                                          {"role": "user", "content": "Name my cat."}], 12)
        assert first.conversation.id == talk.id and first.output_text == chat.choices[0].message.content
        items = list(alpha.conversations.items.list(talk.id, order="asc"))
        assert [i.role for i in items] == ["user", "user", "assistant"] and items[2].id == first.output[0].id
        second = alpha.responses.create(model=model, conversation={"id": talk.id}, input="Again.", max_output_tokens=2,
                                        temperature=0)
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 1
        added = alpha.conversations.items.create(talk.id, items=[{"type": "message", "role": "user", "content": "Hi"}])
        assert len(list(alpha.conversations.items.list(talk.id))) == 6 and added.data[0].id
        alpha.conversations.items.delete(added.data[0].id, conversation_id=talk.id)
        assert len(list(alpha.conversations.items.list(talk.id))) == 5
        for attempt in (lambda: beta.conversations.retrieve(talk.id), lambda: beta.conversations.items.list(talk.id),
                        lambda: beta.responses.create(model=model, conversation=talk.id, input="Hi")):
            with pytest.raises(openai.NotFoundError):
                attempt()
        with pytest.raises(openai.BadRequestError) as refused:
            alpha.responses.create(model=model, conversation=talk.id, previous_response_id=first.id, input="Hi")
        assert refused.value.body["param"] == "conversation"
        assert alpha.conversations.delete(talk.id).deleted
        with pytest.raises(openai.NotFoundError):
            alpha.responses.create(model=model, conversation=talk.id, input="Hi")


def test_a_background_response_whose_router_is_killed_is_run_again_by_the_other(cluster, model):
    """Last in the module: it kills router replica 1. The other replica claims the response once
    its lease lapses and runs it again from its body: it completes with the answer the request
    gets in the foreground, billed once under its request id. A streamed one is not run again
    (its events are out): a reader resuming it on the other replica gets response.failed."""
    ask = {"model": model, "input": "Tell a long story.", "max_output_tokens": 150, "temperature": 0,
           "extra_body": {"ignore_eos": True}}
    with tenant_client(cluster, "alpha", 1) as doomed, tenant_client(cluster, "alpha", 0) as survivor:
        started = doomed.responses.create(**ask, background=True)
        streamed = doomed.responses.create(**ask, background=True, stream=True)
        first = [next(iter(streamed)) for _ in range(3)]
        polled(doomed, started.id, until=("in_progress",))
        name = next(n for n, p in cluster.processes.items() if n.startswith("router") and n != "router")
        cluster.processes[name].send_signal(signal.SIGKILL)
        done = polled(survivor, started.id, until=("completed", "incomplete", "failed"), timeout=90)
        assert done.status == "incomplete" and done.usage.output_tokens == 150, done.error
        assert done.output_text == survivor.responses.create(**ask).output_text
        row = request_status(cluster, 0, started.id.removeprefix("resp_"))
        assert row["status"] == "completed" and row["completion_tokens"] == 150
        rest = list(survivor.responses.retrieve(first[0].response.id, stream=True,
                                                starting_after=first[-1].sequence_number))
        assert rest[-1].type == "response.failed" and rest[-1].response.status == "failed"
        assert "send the request again" in rest[-1].response.error.message
