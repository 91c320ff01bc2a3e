"""Structured outputs through a real cluster on the embedded model, in the host's dtype:
response_format json_schema (strict) and json_object on both HTTP endpoints, streamed or not,
and gRPC's sampling.json_schema; vLLM's structured_outputs (choice, regex, a GBNF grammar) and
its older guided_* fields, and gRPC's sampling.choice; answers parse and match their schemas, in batches mixed with
unconstrained requests, with a LoRA adapter and in streaming mode (a 64-token window); a schema
the engine cannot compile is refused at once naming its part, and one it compiles but cannot
follow to a complete answer fails naming the schema."""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal

import grpc
import jsonschema
import openai
import pytest

from services.common.config import AuthConfig, RouterConfig, SchedulerConfig, WorkerConfig, single_pool
from services.local.cluster import LocalCluster, resolve_model
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import TEST_DTYPE, openai_client, run

pytestmark = pytest.mark.slow

ADMIN_KEY = "structured-outputs-admin"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string", "maxLength": 40}},
    "required": ["name", "age", "city"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Invent a person: their name, age and city."}]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def cluster(adapter_dir):
    config = single_pool(router=RouterConfig(port=0, http_port=0),
                         scheduler=SchedulerConfig(port=0, stream_window_tokens=64),
                         workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=256, dtype=TEST_DTYPE,
                                               adapter_dirs=[str(adapter_dir)])])
    config.auth = AuthConfig(admin_key=ADMIN_KEY)
    with LocalCluster(config, quiet=True) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    with openai_client(cluster, timeout=180) as api:
        yield api


def valid(text: str, schema: dict) -> dict:
    answer = json.loads(text)
    jsonschema.validate(answer, schema)
    return answer


def test_json_schema_on_chat_whole_and_streamed(client, model):
    whole = client.chat.completions.create(model=model, messages=ASK, max_tokens=80, temperature=0,
                                           response_format=PERSON_FORMAT)
    assert whole.choices[0].finish_reason == "stop"
    valid(whole.choices[0].message.content, PERSON)
    stream = client.chat.completions.create(model=model, messages=ASK, max_tokens=80, temperature=0.9, seed=5,
                                            response_format=PERSON_FORMAT, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    valid("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), PERSON)


def test_json_object_on_completions_and_chat(client, model):
    # The client's completions.create has no response_format argument (OpenAI's legacy API lacks it;
    # vLLM's takes it): sent in extra_body.
    text = client.completions.create(model=model, prompt="A JSON object describing a cat:", max_tokens=120,
                                     temperature=0, extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert text.finish_reason == "stop" and isinstance(json.loads(text.text), dict)
    stream = client.completions.create(model=model, prompt="A JSON object describing a cat:", max_tokens=120,
                                       temperature=0, extra_body={"response_format": {"type": "json_object"}},
                                       stream=True)
    assert isinstance(json.loads("".join(c.choices[0].text for c in stream if c.choices)), dict)
    chat = client.chat.completions.create(model=model, messages=ASK, max_tokens=120, temperature=0,
                                          response_format={"type": "json_object"})
    assert isinstance(json.loads(chat.choices[0].message.content), dict)


def test_constrained_and_free_requests_in_one_batch(cluster, model):
    router = cluster.config.router

    async def go():
        async with openai.AsyncOpenAI(base_url=f"http://{router.host}:{router.http_port}/v1", api_key="unused",
                                      max_retries=0, timeout=180) as api:
            calls = [api.chat.completions.create(model=model, messages=ASK, max_tokens=60, temperature=0.8,
                                                 seed=i, **({"response_format": PERSON_FORMAT} if i % 2 else {}))
                     for i in range(8)]
            return await asyncio.gather(*calls)
    answers = run(go())
    for i, answer in enumerate(answers):
        if i % 2:
            valid(answer.choices[0].message.content, PERSON)
    assert any(not a.choices[0].message.content.lstrip().startswith("{") for a in answers[::2])   # free text


def test_grpc_json_schema_and_a_refusal_naming_the_part(cluster):
    async def go(schema):
        request = chat_request(ASK[0]["content"], sampling_params(max_tokens=80, temperature=0.0,
                                                                  json_schema=json.dumps(schema)))
        async with RouterClient(cluster.router_address) as c:
            return await c.generate(request)
    answer = run(go(PERSON))
    assert answer.finish_reason == "stop" and valid(answer.text, PERSON)
    bad = {**PERSON, "properties": {**PERSON["properties"], "city": {"type": "string", "format": "postcode"}}}
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        run(go(bad))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(caught.value.trailing_metadata())["qos-error-field"] == "sampling.json_schema.properties.city"


SENTIMENTS = ["positive", "negative", "neutral"]
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
SQL_GBNF = ('root ::= "SELECT " col " FROM " table " WHERE " col " = " value\n'
            'col ::= "id" | "name" | "city"\ntable ::= "users" | "orders"\nvalue ::= [0-9] [0-9]? [0-9]?')
SQL = r"SELECT (id|name|city) FROM (users|orders) WHERE (id|name|city) = [0-9]{1,3}"


def test_vllm_structured_outputs_choice_regex_and_grammar(client, model):
    """As vLLM's docs show them: extra_body structured_outputs, and the guided_* fields clients
    written for vLLM before 0.12 send; chat and completions, streamed or not."""
    review = [{"role": "user", "content": "Classify the sentiment: the food was cold and the waiter rude."}]
    for extra in ({"structured_outputs": {"choice": SENTIMENTS}}, {"guided_choice": SENTIMENTS}):
        answer = client.chat.completions.create(model=model, messages=review, max_tokens=10, extra_body=extra)
        assert answer.choices[0].message.content in SENTIMENTS and answer.choices[0].finish_reason == "stop"
    date = client.completions.create(model=model, prompt="The treaty was signed on", max_tokens=20, temperature=0,
                                     extra_body={"structured_outputs": {"regex": DATE}}).choices[0]
    assert re.fullmatch(DATE, date.text) and date.finish_reason == "stop", date.text
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Write one SQL query over users."}], max_tokens=40,
        temperature=0.9, seed=11, stream=True, extra_body={"structured_outputs": {"grammar": SQL_GBNF}})
    chunks = list(stream)
    assert re.fullmatch(SQL, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_grpc_choice_and_a_bad_regex_over_both_fronts(cluster, client, model):
    async def go(**guide):
        request = chat_request("Is water wet? Answer.", sampling_params(max_tokens=10, temperature=0.0, **guide))
        async with RouterClient(cluster.router_address) as c:
            return await c.generate(request)
    answer = run(go(choice=["yes", "no"]))
    assert answer.text in ("yes", "no") and answer.finish_reason == "stop"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        run(go(regex="[0-9"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(caught.value.trailing_metadata())["qos-error-field"] == "sampling.regex"
    for extra, param in (({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
                         ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
                         # compiles, but its first mask needs more than a step allows: the scheduler's 400
                         ({"structured_outputs": {"regex": "(a{600}){600}"}}, "structured_outputs.regex"),
                         ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
                          "structured_outputs.choice")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=10, extra_body=extra)
        assert refused.value.param == param


def test_an_uncompilable_schema_is_a_400_naming_its_part(client, model):
    bad = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "pattern": "[a-"}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=10, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    assert caught.value.param == "response_format.json_schema.schema.properties.tags.items"


def test_a_schema_with_no_complete_answer_is_an_error_never_a_stop(client, model):
    """llguidance compiles these but cannot follow them to the end: they came back 200 'stop' with
    '{"' or '' as the answer. Now the request fails naming the schema, whole or streamed: refused
    by the scheduler, whose probe of the first tokens' masks meets the engine's limits (a 400
    before any token), or failing when the grammar allows no next token."""
    for schema in ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                   {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}):
        form = {"type": "json_schema", "json_schema": {"name": "endless", "schema": schema}}
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=30, response_format=form)
        assert caught.value.param == "response_format.json_schema.schema"
        assert any(says in caught.value.message for says in ("allows no next token", "cannot be followed"))
        with pytest.raises(openai.APIError) as caught:
            for chunk in client.chat.completions.create(model=model, messages=ASK, max_tokens=30,
                                                        response_format=form, stream=True):
                assert chunk.choices[0].finish_reason is None
        assert any(says in caught.value.message for says in ("allows no next token", "cannot be followed"))


LIST = {"type": "object", "properties": {"ideas": {"type": "array", "minItems": 6, "maxItems": 6,
                                                   "items": {"type": "string", "minLength": 16, "maxLength": 40}}},
        "required": ["ideas"], "additionalProperties": False}


def test_streaming_mode_and_a_lora_adapter_keep_the_grammar(cluster, client, model, adapter_dir):
    # Streaming mode with a 64-token window: the answer (~80 tokens) outgrows what each token attends.
    ask = [{"role": "user", "content": "Six ideas for a weekend."}]
    windowed = client.chat.completions.create(
        model=model, messages=ask, max_tokens=200, temperature=0, extra_headers={"X-Context-Mode": "streaming"},
        response_format={"type": "json_schema", "json_schema": {"name": "ideas", "schema": LIST}})
    assert windowed.usage.model_extra["streaming"]["window_tokens"] == 64
    assert windowed.usage.completion_tokens > 64 and valid(windowed.choices[0].message.content, LIST)

    from tests.e2e.test_lora import save_adapter          # skips without peft
    save_adapter(resolve_model("default", progress=False), 11, adapter_dir / "tone")
    router = cluster.config.router
    connection = http.client.HTTPConnection(router.host, router.http_port, timeout=300)
    connection.request("POST", "/v1/load_lora_adapter", body=json.dumps(
        {"lora_name": "tone", "lora_path": str(adapter_dir / "tone")}),
        headers={"content-type": "application/json", "authorization": f"Bearer {ADMIN_KEY}"})
    assert connection.getresponse().status == 200
    connection.close()
    answer = client.chat.completions.create(model="tone", messages=ASK, max_tokens=80, temperature=0,
                                            response_format=PERSON_FORMAT)
    valid(answer.choices[0].message.content, PERSON)


def test_json_streams_of_a_killed_worker_finish_on_the_other_exactly(tmp_path):
    """Each stream's grammar state is rebuilt from its tokens on the worker that takes it over:
    in fp32 every answer equals the undisturbed one, and all are valid (the random-weight bench
    model: only the grammar makes its text JSON)."""
    from tests.e2e.test_failover import fault_config, pool_stats
    config = fault_config("fp32", cache_affinity_margin=0.0)
    schema = json.dumps(PERSON)

    async def streams(client, kill=None):
        started = [asyncio.Event() for _ in range(8)]

        async def one(i):
            request = chat_request(f"Person number {i}", sampling_params(max_tokens=60, temperature=0.0,
                                                                         json_schema=schema))
            tokens, text = [], ""
            async for chunk in client.stream(request):
                tokens += chunk.token_ids
                text += chunk.text
                if len(tokens) >= 3:
                    started[i].set()
            return tokens, text
        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        if kill is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            await kill()
        return await asyncio.wait_for(asyncio.gather(*tasks), 300)

    with LocalCluster(config, quiet=True) as cluster:
        async def go():
            async with RouterClient(cluster.router_address) as client:
                reference = await streams(client)

                async def kill_busiest():
                    busiest = max((await pool_stats(cluster)).members, key=lambda m: m.running)
                    index = [w.address for w in config.pools[0].workers].index(busiest.address)
                    cluster.processes[f"cpu/worker-{index}"].send_signal(signal.SIGKILL)
                return reference, await streams(client, kill_busiest), await pool_stats(cluster)
        reference, got, stats = run(go())
    assert stats.failovers > 0
    assert got == reference
    for _, text in got:
        valid(text, PERSON)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}, "strict": True}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 60}}, "required": ["query"],
    "additionalProperties": False}}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Lisbon?"}]


def test_a_named_call_returns_tool_calls_whole_and_streamed(client, model):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=model, messages=WEATHER_ASK, tools=[WEATHER, SEARCH],
                                           tool_choice=choice, temperature=0, max_tokens=60)
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    valid(call.function.arguments, WEATHER["function"]["parameters"])
    # Streamed: the official client's own accumulation of OpenAI's tool_calls deltas.
    with client.beta.chat.completions.stream(model=model, messages=WEATHER_ASK, tools=[WEATHER, SEARCH],
                                             tool_choice=choice, temperature=0, max_tokens=60) as stream:
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)


def test_required_calls_one_of_the_tools_and_streams_the_same(client, model):
    ask = [{"role": "user", "content": "Find recipes for lemon cake."}]
    whole = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER, SEARCH], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=80)
    (call,) = whole.choices[0].message.tool_calls
    tool = {"get_weather": WEATHER, "search": SEARCH}[call.function.name]
    valid(call.function.arguments, tool["function"]["parameters"])
    stream = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER, SEARCH], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=80, stream=True)
    deltas = [d for c in stream if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == call.function.name and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_auto_says_the_model_has_no_tool_format_and_tool_turns_are_taken(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=WEATHER_ASK, tools=[WEATHER], max_tokens=10)
    assert caught.value.param == "tool_choice" and "no tool-call format" in caught.value.message
    history = WEATHER_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Lisbon", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    answer = client.chat.completions.create(model=model, messages=history, max_tokens=30, temperature=0)
    assert answer.choices[0].message.content and answer.usage.prompt_tokens > 30
