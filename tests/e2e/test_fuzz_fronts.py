"""Fuzzing both fronts of a real router with generated bad requests (hypothesis): 1,500 HTTP
bodies (and 300 each of TGI's and SGLang's) and 600 gRPC requests, each made invalid in one way (wrong types, huge numbers, NaN,
invalid UTF-8, lone surrogates, deep nesting, empty and oversized bodies, unknown fields, bad
headers). Every one must get a 4xx (or INVALID_ARGUMENT) naming the field at fault, quickly;
never a 5xx, a hang or a crash; and the router must serve normally afterwards."""
from __future__ import annotations

import http.client
import json
import math
import string
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.local.cluster import LocalCluster
from services.router.openai_api.service_class import TIERS
from services.router.openai_api.request import FIELDS, MAX_CHOICES, NEUTRAL
from services.router.openai_api.responses_request import NEUTRAL as RESPONSES_NEUTRAL
from services.router.openai_api.responses_request import OWN, PASSED
from services.router.openai_api.sglang import SAMPLING as SGLANG_SAMPLING
from services.router.openai_api.tgi import PARAMETERS as TGI_PARAMETERS
from tests.e2e.conftest import cluster_config

pytestmark = pytest.mark.slow

HTTP_EXAMPLES, GRPC_EXAMPLES = 1500, 600
FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def cluster():
    config = cluster_config()
    config.router.http_max_body_bytes = 256 * 1024
    with LocalCluster(config, quiet=True) as running:
        yield running


# --- HTTP ---------------------------------------------------------------------------------------

def anything_but(*kinds):
    """JSON values of every kind except those listed (never null: null means "absent")."""
    pool = {"int": st.integers(-2**70, 2**70), "float": st.floats(allow_nan=False, allow_infinity=False),
            "str": st.text(max_size=8), "bool": st.booleans(), "list": st.lists(st.integers(), max_size=3),
            "dict": st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)}
    return st.one_of(*(s for k, s in pool.items() if k not in kinds))


NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
BAD = {
    "model": st.one_of(anything_but("str"), st.just("")),
    "max_tokens": st.one_of(st.integers(max_value=0), st.integers(min_value=2**31), anything_but("int")),
    "temperature": st.one_of(st.floats(max_value=-1e-6), st.floats(min_value=2.001), NON_FINITE,
                             anything_but("int", "float")),
    "top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.001), NON_FINITE,
                       anything_but("int", "float")),
    "top_k": st.one_of(st.integers(max_value=-2), anything_but("int")),
    "seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64), anything_but("int")),
    "n": st.one_of(st.integers(max_value=0), st.integers(min_value=MAX_CHOICES + 1), anything_but("int")),
    "stop": st.one_of(anything_but("str", "list"), st.just(""), st.lists(st.text(min_size=1), min_size=17),
                      st.lists(anything_but("str"), min_size=1, max_size=3)),
    "stream": anything_but("bool"),
    "ignore_eos": anything_but("bool"),
    "stream_options": st.dictionaries(st.text(max_size=5), st.booleans(), max_size=2),  # without stream
    "service_tier": st.one_of(st.text().filter(lambda t: t not in TIERS), anything_but("str")),
    "priority": st.one_of(st.integers(max_value=-2**63 - 1), st.integers(min_value=2**63), anything_but("int")),
    "user": anything_but("str"),
    "stop_token_ids": st.one_of(anything_but("list"), st.lists(st.integers(max_value=-1), min_size=1)),
    "messages": st.one_of(anything_but("list"), st.just([]), st.lists(anything_but("dict"), min_size=1),
                          st.lists(st.fixed_dictionaries({"role": st.text().filter(lambda r: r not in (
                              "system", "developer", "user", "assistant", "tool")), "content": st.text()}),
                              min_size=1)),
    "logprobs": anything_but("bool"),
    "top_logprobs": st.one_of(st.integers(max_value=-1), st.integers(min_value=21), anything_but("int")),
    "frequency_penalty": st.one_of(st.floats(min_value=2.001, max_value=1e300), st.floats(max_value=-2.001, min_value=-1e300),
                                   anything_but("int", "float")),
    "logit_bias": st.one_of(anything_but("dict"), st.dictionaries(st.text(min_size=1).filter(lambda k: not k.isdigit()),
                                                                  st.integers(), min_size=1, max_size=2)),
    "tools": st.lists(st.dictionaries(st.text(max_size=3), st.integers()), min_size=1, max_size=2),
}
KNOWN = FIELDS["chat"] | set(NEUTRAL)
RESPONSES_KNOWN = PASSED | OWN | set(RESPONSES_NEUTRAL)


def base_body(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


bodies = st.one_of(
    # a valid request with one field made invalid
    st.sampled_from(sorted(BAD)).flatmap(lambda f: st.tuples(st.just(f), BAD[f])).map(lambda fv: ("field", fv)),
    # a field nobody defined
    st.tuples(st.text(min_size=1, max_size=12).filter(lambda k: k not in KNOWN), anything_but())
      .map(lambda kv: ("unknown", kv)),
    # not a request at all: random bytes, other JSON values, nesting, broken text
    st.binary(max_size=200).map(lambda b: ("raw", b)),
    anything_but("dict").map(lambda v: ("raw", json.dumps(v).encode())),
    st.integers(1000, 60_000).map(lambda n: ("raw", b"[" * n + b"]" * n)),
    st.integers(1000, 60_000).map(lambda n: ("raw", b'{"a":' * n + b"1" + b"}" * n)),
    st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80"]).map(lambda b: ("utf8", b)),
    st.sampled_from(["\\ud800", "\\udfff", "a\\ud83d"]).map(lambda s: ("surrogate", s)),
)


def render(model: str, kind: str, value) -> bytes:
    body = base_body(model)
    if kind == "field":
        field, bad = value
        body[field] = bad
        return json.dumps(body).encode()
    if kind == "unknown":
        body[value[0]] = value[1]
        return json.dumps(body).encode()
    if kind == "utf8":       # invalid UTF-8 inside a string of an otherwise valid body
        return json.dumps(body).encode().replace(b'"Hi"', b'"H' + value + b'i"')
    if kind == "surrogate":
        return json.dumps(body).encode().replace(b'"Hi"', b'"' + value.encode() + b'"')
    return value


def post(cluster, raw: bytes, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    router = cluster.config.router
    conn = http.client.HTTPConnection(router.host, router.http_port, timeout=10)
    try:
        conn.request("POST", path, body=raw, headers={"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_http_bodies_get_a_4xx_naming_the_field(cluster):
    model = Path(cluster.config.model).name
    statuses: dict[int, int] = {}

    @settings(FUZZ, max_examples=HTTP_EXAMPLES)
    @given(bodies)
    @example(("raw", b""))
    @example(("raw", b"x" * (256 * 1024 + 1)))
    def check(case):
        status, answer = post(cluster, render(model, *case))
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (400, 404, 413), (case, status, answer)
        assert isinstance(answer["error"]["param"], str) and answer["error"]["param"], (case, answer)
        assert answer["error"]["message"]

    check()
    print(f"\nHTTP fuzz: {sum(statuses.values())} bodies, statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= HTTP_EXAMPLES and statuses.get(400, 0) > HTTP_EXAMPLES // 2
    status, answer = post(cluster, json.dumps(base_body(model)).encode())     # still serving
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


# --- HTTP: the Responses API ---------------------------------------------------------------------

RESPONSES_EXAMPLES = 500
ITEM_BAD = st.one_of(anything_but("dict"), st.dictionaries(st.text(max_size=6), anything_but(), max_size=3),
                     st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                            "content": st.one_of(anything_but("str", "list"), st.lists(
                                                st.dictionaries(st.text(max_size=5), st.text(max_size=4)),
                                                min_size=1, max_size=2))}),
                     st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output",
                                                                     "reasoning", "input_image"]),
                                            "call_id": anything_but("str")}))
RESPONSES_BAD = {
    "model": BAD["model"], "temperature": BAD["temperature"], "top_p": BAD["top_p"], "stream": BAD["stream"],
    "input": st.one_of(anything_but("str", "list"), st.just([]), st.lists(ITEM_BAD, min_size=1, max_size=3)),
    "instructions": anything_but("str"),
    "max_output_tokens": st.one_of(st.integers(max_value=0), st.integers(min_value=2**31), anything_but("int")),
    "text": st.one_of(anything_but("dict"), st.fixed_dictionaries({"format": st.one_of(
        anything_but("dict"), st.dictionaries(st.sampled_from(["type", "name", "schema"]), anything_but(),
                                              min_size=1))})),
    "tools": st.one_of(anything_but("list"), st.lists(st.one_of(anything_but("dict"), st.fixed_dictionaries(
        {"type": st.text(max_size=8).filter(lambda t: t != "function")})), min_size=1, max_size=2)),
    "tool_choice": st.one_of(st.text(max_size=8).filter(lambda t: t not in ("none",)), anything_but("str")),
    "include": st.one_of(anything_but("list"), st.lists(st.text(max_size=10), min_size=1, max_size=2)),
    "store": anything_but("bool"), "background": anything_but("bool"), "previous_response_id": anything_but(),
    "metadata": st.one_of(anything_but("dict"), st.dictionaries(st.text(max_size=4), anything_but("str"),
                                                                min_size=1, max_size=2)),
}
responses_bodies = st.one_of(
    st.sampled_from(sorted(RESPONSES_BAD)).flatmap(lambda f: st.tuples(st.just(f), RESPONSES_BAD[f])),
    st.tuples(st.text(min_size=1, max_size=12).filter(lambda k: k not in RESPONSES_KNOWN), anything_but()),
)


def test_responses_bodies_get_a_4xx_naming_the_field(cluster):
    model = Path(cluster.config.model).name
    statuses: dict[int, int] = {}

    @settings(FUZZ, max_examples=RESPONSES_EXAMPLES)
    @given(responses_bodies)
    def check(case):
        field, bad = case
        status, answer = post(cluster, json.dumps({"model": model, "input": "Hi", "max_output_tokens": 2,
                                                   field: bad}).encode(), "/v1/responses")
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (400, 404), (case, status, answer)
        assert isinstance(answer["error"]["param"], str) and answer["error"]["param"], (case, answer)

    check()
    print(f"\nResponses fuzz: {sum(statuses.values())} bodies, statuses {dict(sorted(statuses.items()))}")
    status, answer = post(cluster, json.dumps({"model": model, "input": "Hi", "max_output_tokens": 2}).encode(),
                          "/v1/responses")
    assert status == 200 and answer["usage"]["output_tokens"] == 2


TGI_EXAMPLES = 300
TGI_BAD = {
    "max_new_tokens": st.one_of(anything_but("int"), st.integers(max_value=0), st.integers(min_value=2**31)),
    "temperature": st.one_of(anything_but("int", "float"), st.floats(max_value=-0.01), NON_FINITE),
    "top_p": st.one_of(anything_but("int", "float"), st.floats(min_value=1.01), st.floats(max_value=0.0)),
    "top_k": st.one_of(anything_but("int"), st.integers(max_value=-1)),
    "stop": st.one_of(anything_but("list", "str"), st.lists(st.just(""), min_size=1, max_size=2)),
    "details": anything_but("bool"), "do_sample": anything_but("bool"), "return_full_text": anything_but("bool"),
    "top_n_tokens": st.one_of(anything_but("int"), st.integers(min_value=21)),
    "grammar": st.one_of(anything_but("dict"), st.fixed_dictionaries({"type": st.text(max_size=6)
                                                                      .filter(lambda t: t not in ("json", "regex"))})),
    "best_of": st.integers(min_value=2), "watermark": st.just(True),
    "typical_p": st.one_of(anything_but("int", "float"), st.floats(min_value=1.01), st.floats(max_value=0.0)),
    "decoder_input_details": anything_but("bool"),
}
tgi_cases = st.one_of(
    st.sampled_from(sorted(TGI_BAD)).flatmap(lambda f: st.tuples(st.just(f), TGI_BAD[f])),
    st.tuples(st.text(min_size=1, max_size=12).filter(lambda k: k not in TGI_PARAMETERS), anything_but()),
)


def test_tgi_bodies_get_a_422_naming_the_parameter(cluster):
    """TGI's routes answer in TGI's error shape (tgi.py): {"error", "error_type": "validation"}."""
    statuses: dict[int, int] = {}

    @settings(FUZZ, max_examples=TGI_EXAMPLES)
    @given(tgi_cases)
    def check(case):
        name, bad = case
        status, answer = post(cluster, json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 2, name: bad}})
                              .encode(), "/generate")
        statuses[status] = statuses.get(status, 0) + 1
        assert status == 422 and answer["error_type"] == "validation", (case, status, answer)
        assert f"parameters.{name}" in answer["error"], (case, answer)

    check()
    print(f"\nTGI fuzz: {sum(statuses.values())} bodies, statuses {dict(sorted(statuses.items()))}")
    status, answer = post(cluster, b'{"inputs": "Hi", "parameters": {"max_new_tokens": 2}}', "/generate")
    assert status == 200 and answer["generated_text"]


SGLANG_EXAMPLES = 300
SGLANG_BAD = {
    "max_new_tokens": st.one_of(anything_but("int"), st.integers(max_value=0), st.integers(min_value=2**31)),
    "temperature": st.one_of(anything_but("int", "float"), st.floats(max_value=-0.01), NON_FINITE),
    "top_p": st.one_of(anything_but("int", "float"), st.floats(min_value=1.01)),
    "top_k": st.one_of(anything_but("int"), st.integers(max_value=-2)),
    "min_p": st.one_of(anything_but("int", "float"), st.floats(min_value=1.01)),
    "stop": st.one_of(anything_but("list", "str"), st.lists(st.just(""), min_size=1, max_size=2)),
    "n": st.one_of(anything_but("int"), st.integers(max_value=0), st.integers(min_value=17)),
    "json_schema": st.one_of(anything_but("str", "dict"), st.text(max_size=5).filter(lambda t: not t.strip()
                                                                                       .startswith(("{", "t", "f")))),
    "regex": st.just("("), "no_stop_trim": anything_but("bool"),
}


def test_sglang_bodies_get_a_400_naming_the_field(cluster):
    """SGLang's /generate bodies (sglang.py): OpenAI's error objects, the field as the body has it."""
    statuses: dict[int, int] = {}

    @settings(FUZZ, max_examples=SGLANG_EXAMPLES)
    @given(st.one_of(
        st.sampled_from(sorted(SGLANG_BAD)).flatmap(lambda f: st.tuples(st.just(f), SGLANG_BAD[f])),
        st.tuples(st.text(min_size=1, max_size=12).filter(lambda k: k not in SGLANG_SAMPLING), anything_but())))
    def check(case):
        name, bad = case
        status, answer = post(cluster, json.dumps({"text": "Hi", "sampling_params": {"max_new_tokens": 2, name: bad}})
                              .encode(), "/generate")
        statuses[status] = statuses.get(status, 0) + 1
        assert status == 400 and answer["error"]["param"].startswith("sampling_params"), (case, status, answer)

    check()
    print(f"\nSGLang fuzz: {sum(statuses.values())} bodies, statuses {dict(sorted(statuses.items()))}")
    status, answer = post(cluster, b'{"text": "Hi", "sampling_params": {"max_new_tokens": 2}}', "/generate")
    assert status == 200 and answer["meta_info"]["completion_tokens"] == 2


# --- gRPC ---------------------------------------------------------------------------------------

ASCII = st.text(alphabet=string.ascii_letters + string.digits + "-_ ", max_size=10)
SAMPLING_BAD = st.one_of(
    st.integers(-2**31, 0).map(lambda v: {"max_tokens": v}),
    st.integers(8192, 2**31 - 1).map(lambda v: {"max_tokens": v}),
    st.one_of(st.floats(max_value=-0.5, width=32), NON_FINITE).map(lambda v: {"temperature": v}),
    st.one_of(st.floats(max_value=0.0, width=32), st.floats(min_value=1.5, width=32), NON_FINITE)
      .map(lambda v: {"top_p": v}),
    st.integers(-2**31, -1).map(lambda v: {"top_k": v}),
    st.lists(st.text(max_size=3), max_size=2).map(lambda s: {"stop": s + [""]}),
    st.one_of(st.lists(st.text(alphabet=" \t", max_size=3), min_size=1, max_size=2),       # blank words
              st.lists(st.just("x"), min_size=65, max_size=66)).map(lambda w: {"bad_words": w}),  # too many
)
grpc_cases = st.one_of(
    st.binary(max_size=30).map(lambda b: ("body", router_pb2.GenerateRequestBytes(prompt=b + b"\xff"))),
    st.binary(max_size=30).map(lambda b: ("body", router_pb2.GenerateRequestBytes(
        messages=[router_pb2.ChatMessageBytes(role=b"user", content=b + b"\xff")]))),   # never UTF-8
    ASCII.filter(lambda r: r not in ("system", "user", "assistant", "tool")).map(lambda r: ("body",
        router_pb2.GenerateRequestBytes(messages=[router_pb2.ChatMessageBytes(role=r.encode(), content=b"x")]))),
    st.just(("body", router_pb2.GenerateRequestBytes())),
    st.just(("body", router_pb2.GenerateRequestBytes(prompt=b"x", messages=[
        router_pb2.ChatMessageBytes(role=b"user", content=b"y")]))),
    SAMPLING_BAD.map(lambda s: ("body", router_pb2.GenerateRequestBytes(
        prompt=b"x", sampling=common_pb2.SamplingParams(**s)))),
    ASCII.filter(lambda p: p.strip().lower() not in ("high", "medium", "low"))
      .map(lambda p: ("meta", ("x-priority", p))),
    ASCII.filter(lambda v: not v.strip().isdigit() or int(v) <= 0).map(lambda v: ("meta", ("x-slo-ms", v))),
    st.sampled_from(["+5", "5_0", "1e3", "-1", "0", " "]).map(lambda v: ("meta", ("x-slo-ms", v))),
    st.sampled_from(["+5", "1e3", "-1", "0", "many", str(2**31)]).map(lambda v: ("meta", ("x-stream-interval", v))),
    st.just(("meta", ("x-slo-ms", str(2**32)))),
)


def test_grpc_requests_get_invalid_argument_naming_the_field(cluster):
    channel = grpc.insecure_channel(cluster.router_address)
    generate = channel.unary_stream("/qos.v1.Router/Generate",
                                    request_serializer=router_pb2.GenerateRequestBytes.SerializeToString,
                                    response_deserializer=common_pb2.GenerateChunk.FromString)
    seen = []

    @settings(FUZZ, max_examples=GRPC_EXAMPLES)
    @given(grpc_cases)
    def check(case):
        kind, value = case
        request = value if kind == "body" else router_pb2.GenerateRequestBytes(prompt=b"Hi")
        metadata = [value] if kind == "meta" else []
        with pytest.raises(grpc.RpcError) as caught:
            list(generate(request, metadata=metadata, timeout=10))
        error = caught.value
        trailers = dict(error.trailing_metadata() or ())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, error.details())
        assert trailers.get("qos-error-field") and trailers["qos-error-field"].split("[")[0].split(".")[0] \
            in error.details(), (case, error.details(), trailers)
        seen.append(kind)

    try:
        check()
        print(f"\ngRPC fuzz: {len(seen)} requests, all INVALID_ARGUMENT naming the field")
        assert len(seen) >= GRPC_EXAMPLES
        ok = list(generate(router_pb2.GenerateRequestBytes(
            prompt=b"Hi", sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=60))
        assert ok[-1].finish_reason and ok[-1].usage.completion_tokens == 2
    finally:
        channel.close()
