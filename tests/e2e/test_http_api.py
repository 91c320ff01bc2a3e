"""The OpenAI-compatible HTTP front against a real local cluster, driven by the official `openai`
client (and raw HTTP where a client library would hide what is on the wire): the same text as
the gRPC path, usage, the class a request is served in, precise errors."""
from __future__ import annotations

import http.client
import json

import openai
import pytest

from services.common.priority import HIGH, LOW, MEDIUM
from services.common.proto.qos.v1 import router_pb2
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import run

pytestmark = pytest.mark.slow

PROMPT = "Name three colours of the rainbow."
TOKENS = 24


@pytest.fixture(scope="module")
def cluster(fp32_cluster):
    # fp32: HTTP answers are compared with the gRPC path's on the same prompt, the second served
    # from the first's cached prefix; equal texts hold where cached and recomputed blocks hold the
    # same numbers. The session's shared cluster (tests/e2e/conftest.py).
    return fp32_cluster


def grpc_answer(cluster, request):
    async def go():
        async with RouterClient(cluster.router_address) as c:
            return await c.generate(request, priority="medium")
    return run(go())


def raw(cluster, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    router = cluster.config.router
    conn = http.client.HTTPConnection(router.host, router.http_port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def class_tokens(cluster) -> dict[int, int]:
    async def go():
        stats = await cluster.pool_stats()
        return {c.priority: c.output_tokens for c in stats.classes}
    return run(go())


def test_models_lists_the_pools_model(client, cluster):
    models = client.models.list().data
    assert len(models) == 1 and models[0].owned_by == "qos-serve"
    one = client.models.retrieve(models[0].id)          # GET /v1/models/{model}
    assert one.model_dump() == models[0].model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such/model")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    status, _, body = raw(cluster, "GET", "/health")
    assert status == 200 and json.loads(body)["pools"] == ["cpu"]


def test_tokenize_and_detokenize_use_the_models_tokenizer(client, cluster, model):
    """vLLM's /tokenize and /detokenize: a prompt's ids are the model tokenizer's own and as many
    as a completion's usage counts; messages as a chat renders them; back to the same text."""
    from services.common.tokenizer import TextTokenizer
    from services.engine.default_model import default_model_dir
    tokenizer = TextTokenizer.from_model_dir(default_model_dir(progress=False))

    def post(path, body):
        status, _, data = raw(cluster, "POST", path, json.dumps(body).encode())
        return status, json.loads(data)

    status, done = post("/tokenize", {"model": model, "prompt": PROMPT})
    assert status == 200 and done["tokens"] == tokenizer.encode(PROMPT) and done["count"] == len(done["tokens"])
    assert done["token_strs"] is None
    spelled = post("/tokenize", {"model": model, "prompt": PROMPT, "return_token_strs": True})[1]["token_strs"]
    assert spelled == [tokenizer.tokenizer.id_to_token(t) for t in done["tokens"]] and len(spelled) == done["count"]
    assert done["max_model_len"] == client.models.retrieve(model).model_extra["max_model_len"]
    assert done["count"] == client.completions.create(model=model, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    messages = [{"role": "user", "content": PROMPT}]
    status, chat = post("/tokenize", {"model": model, "messages": messages, "add_generation_prompt": True})
    assert status == 200 and chat["tokens"] == tokenizer.encode_chat(messages)
    assert chat["count"] == client.chat.completions.create(model=model, messages=messages, max_tokens=1).usage.prompt_tokens
    assert post("/detokenize", {"model": model, "tokens": done["tokens"]}) == (200, {"prompt": PROMPT})
    status, text = post("/detokenize", {"model": model, "tokens": chat["tokens"]})
    assert status == 200 and PROMPT in text["prompt"] and "<|im_start|>" in text["prompt"]   # special tokens kept
    for path, body, param in (
            ("/tokenize", {"model": "no-such/model", "prompt": "x"}, "model"),
            ("/tokenize", {"model": model}, "prompt"),
            ("/tokenize", {"model": model, "prompt": "x", "messages": messages}, "prompt"),
            ("/tokenize", {"model": model, "messages": messages, "add_special_tokens": True}, "add_special_tokens"),
            ("/tokenize", {"model": model, "prompt": "x", "return_token_strs": 1}, "return_token_strs"),
            ("/tokenize", {"model": model, "prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
            ("/tokenize", {"model": model, "prompt": "x", "temperature": 1}, "temperature"),
            ("/detokenize", {"model": model, "tokens": [1, 10**9]}, "tokens[1]"),
            ("/detokenize", {"model": model, "tokens": [1, "a"]}, "tokens[1]")):
        status, error = post(path, body)
        assert status == (404 if param == "model" else 400) and error["error"]["param"] == param, (body, error)


def test_chat_equals_the_grpc_path_streaming_or_not(client, cluster, model):
    reference = grpc_answer(cluster, chat_request(PROMPT, sampling_params(max_tokens=TOKENS, temperature=0.0)))
    whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=TOKENS, temperature=0)
    assert whole.choices[0].message.content == reference.text
    assert whole.choices[0].finish_reason == reference.finish_reason
    assert whole.usage.completion_tokens == len(reference.token_ids)
    assert whole.usage.total_tokens == reference.total_tokens
    assert whole.object == "chat.completion" and whole.service_tier == "default"

    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reference.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference.token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_equal_the_grpc_path_streaming_or_not(client, cluster, model):
    prompt = "The three primary colours are"
    reference = grpc_answer(cluster, router_pb2.GenerateRequest(
        prompt=prompt, sampling=sampling_params(max_tokens=TOKENS, temperature=0.0)))
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=TOKENS, temperature=0)
    assert whole.choices[0].text == reference.text
    assert whole.usage.completion_tokens == len(reference.token_ids)
    assert whole.usage.total_tokens == reference.total_tokens
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=TOKENS,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == reference.text
    # vLLM's continuous_usage_stats: every chunk's usage so far, the last one's the whole
    counted = list(client.completions.create(
        model=model, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    so_far = [c.usage.completion_tokens for c in counted]
    assert so_far == sorted(so_far) and so_far[-1] == len(reference.token_ids) and len(set(so_far)) > 2
    assert {c.usage.prompt_tokens for c in counted} == {reference.total_tokens - len(reference.token_ids)}


@pytest.mark.parametrize("header, tier, priority, served_as, tier_echoed", [
    ("high", None, None, HIGH, "priority"),
    ("LOW", None, None, LOW, "flex"),
    (None, "priority", None, HIGH, "priority"),
    (None, "flex", None, LOW, "flex"),
    (None, "auto", None, MEDIUM, "default"),
    (None, None, -1, HIGH, "priority"),       # vLLM's priority: lower is sooner
    (None, None, 0, MEDIUM, "default"),
    (None, None, 7, LOW, "flex"),
    ("low", "flex", 3, LOW, "flex"),          # all three, agreeing
])
def test_x_priority_service_tier_and_priority_reach_the_scheduler_as_the_class(
        client, cluster, model, header, tier, priority, served_as, tier_echoed):
    before = class_tokens(cluster)
    extra = {"service_tier": tier} if tier else {}
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True, **({"priority": priority} if priority is not None else {})},
        extra_headers={"X-Priority": header} if header else None, **extra)
    after = class_tokens(cluster)
    served = {p: after[p] - before[p] for p in after}
    assert served[served_as] == answer.usage.completion_tokens == 5
    assert sum(served.values()) == 5
    assert answer.service_tier == tier_echoed


@pytest.mark.parametrize("header, body, param", [
    ("low", {"service_tier": "priority"}, "service_tier"),
    ("high", {"priority": 1}, "priority"),
    (None, {"priority": -1, "service_tier": "flex"}, "priority"),
])
def test_classes_that_differ_are_a_400_naming_the_body_field_on_both_endpoints(client, model, header, body,
                                                                               param):
    headers = {"X-Priority": header} if header else None
    for create, fields in [(client.chat.completions.create, {"messages": [{"role": "user", "content": "Hi"}]}),
                           (client.completions.create, {"prompt": "Hi"})]:
        with pytest.raises(openai.BadRequestError) as caught:
            create(model=model, max_tokens=2, extra_body=body, extra_headers=headers, **fields)
        assert caught.value.status_code == 400 and caught.value.param == param


def test_request_id_header_and_chunk_ids_agree(cluster, model):
    status, headers, body = raw(cluster, "POST", "/v1/chat/completions", json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}).encode())
    assert status == 200 and json.loads(body)["id"] == "chatcmpl-" + headers["x-request-id"]


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 17), ("temperature", -1), ("temperature", "hot"), ("top_p", 0), ("max_tokens", 0),
    ("max_tokens", 10**30), ("seed", -5), ("stop", [1, 2]), ("service_tier", "scale"),
    ("stream", "yes"), ("logprobs", "yes"), ("top_logprobs", 21), ("tools", [{"type": "function"}]), ("colour", "red"),
    ("messages", []), ("top_k", -3), ("ignore_eos", 1), ("stop_token_ids", [2, 49152]),
])
def test_each_invalid_field_is_a_400_naming_it(client, model, field, value):
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], field: value}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{k: v for k, v in body.items() if k in ("model", "messages")},
                                       extra_body={k: v for k, v in body.items() if k not in ("model", "messages")})
    param = caught.value.param           # the field, or the element of it at fault ("stop[0]")
    assert caught.value.status_code == 400 and (param == field or param.startswith(field + "["))
    assert caught.value.type == "invalid_request_error"
    assert "sampling." not in caught.value.message          # named as the client sent it


def test_a_bad_header_and_a_max_tokens_over_the_context_name_what_is_wrong(cluster, model):
    body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 9000}).encode()
    status, _, answer = raw(cluster, "POST", "/v1/completions", body)
    assert status == 400 and json.loads(answer)["error"]["param"] == "max_tokens"
    status, _, answer = raw(cluster, "POST", "/v1/completions", body, {"X-Priority": "urgent"})
    assert status == 400 and json.loads(answer)["error"]["param"] == "x-priority"
    # A tenant name the ledger could not store (its column holds 64 characters) never reaches it.
    fits = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 2}).encode()
    status, _, answer = raw(cluster, "POST", "/v1/completions", fits, {"X-Tenant": "t" * 65})
    assert status == 400 and json.loads(answer)["error"]["param"] == "x-tenant"
    status, _, _ = raw(cluster, "POST", "/v1/completions", fits, {"X-Tenant": "t" * 64})
    assert status == 200
    for path in ("/v1/usage", "/v1/alerts"):       # the same rule wherever x-tenant is read
        status, _, answer = raw(cluster, "GET", path, None, {"X-Tenant": "t" * 65})
        assert status == 400 and json.loads(answer)["error"]["param"] == "x-tenant", (path, answer)


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.param == "model" and "gpt-9" in caught.value.message


def test_unknown_paths_and_methods_answer_in_openai_shape(cluster):
    status, _, body = raw(cluster, "GET", "/v1/embeddings")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
    status, _, body = raw(cluster, "GET", "/v1/chat/completions")
    assert status == 405 and "error" in json.loads(body)
