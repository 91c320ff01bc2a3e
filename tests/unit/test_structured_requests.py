"""response_format (HTTP) and sampling.json_schema (gRPC) at the router's front door: compiled at
once, a schema the grammar engine cannot compile refused naming its innermost part."""
from __future__ import annotations

import json

import pytest

from services.common.errors import ErrorKind, ServiceError
from services.common.grammar import ANY_OBJECT, check_schema
from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.router.openai_api.request import CHAT, COMPLETION, parse_openai
from services.router.validation import decode_request

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def chat(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return parse_openai(CHAT, json.dumps(body).encode())


def refused(call, *args, **kwargs) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        call(*args, **kwargs)
    assert caught.value.kind is ErrorKind.INVALID
    return caught.value


def test_each_response_format_becomes_a_schema_or_none():
    assert chat(response_format={"type": "text"}).body.sampling.json_schema == ""
    assert chat(response_format={"type": "json_object"}).body.sampling.json_schema == ANY_OBJECT
    strict = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "Person", "schema": PERSON, "strict": True}}).body.sampling.json_schema
    assert json.loads(strict) == PERSON
    completion = parse_openai(COMPLETION, json.dumps({"model": "m", "prompt": "x", "response_format": {
        "type": "json_object"}}).encode())
    assert completion.body.sampling.json_schema == ANY_OBJECT


@pytest.mark.parametrize("schema, where, says", [
    ({"type": "object", "properties": {"age": {"type": "string", "format": "bogus"}}},
     "response_format.json_schema.schema.properties.age", "Unknown format: bogus"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "objekt"}}}}},
     "response_format.json_schema.schema.properties.a.properties.b", "objekt"),
    ({"type": "object", "properties": {"code": {"anyOf": [{"type": "string"}, {"type": "string", "pattern": "(["}]}}},
     "response_format.json_schema.schema.properties.code.anyOf[1]", "unclosed character class"),
    ({"type": "object", "properties": {"n": {"$ref": "#/$defs/missing"}}},
     "response_format.json_schema.schema.properties.n", "does not exist"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 2}}, "required": ["n"]},
     "response_format.json_schema.schema.properties.n", "nsatisfiable"),
    ("an object, please", "response_format.json_schema.schema", "must be a JSON Schema"),
    ({"type": "object", "properties": {"a": {"enum": ["\ud800"]}}},          # a lone surrogate: never on the wire
     "response_format.json_schema.schema.properties.a", "hex escape"),
])
def test_a_schema_that_cannot_compile_is_refused_naming_its_part(schema, where, says):
    error = refused(chat, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert error.field == where and says in error.message


def test_definitions_resolve_when_a_part_is_compiled_alone():
    good = {"type": "object", "$defs": {"age": {"type": "integer"}},
            "properties": {"a": {"$ref": "#/$defs/age"}, "b": {"type": "string", "format": "nope"}}}
    assert refused(check_schema, good, "s").field == "s.properties.b"


@pytest.mark.parametrize("value, field", [
    ({"type": "xml"}, "response_format.type"),
    ("json", "response_format"),
    ({"type": "json_object", "schema": {}}, "response_format.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": PERSON}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "extra": 1}},
     "response_format.json_schema.extra"),
])
def test_a_malformed_response_format_is_refused_naming_the_field(value, field):
    assert refused(chat, response_format=value).field == field


def test_ignore_eos_cannot_come_with_a_json_answer():
    assert refused(chat, response_format={"type": "json_object"}, ignore_eos=True).field == "ignore_eos"


def grpc_request(schema_text: str, **sampling) -> router_pb2.GenerateRequestBytes:
    return router_pb2.GenerateRequestBytes(prompt=b"Hi", sampling=common_pb2.SamplingParams(
        json_schema=schema_text, **sampling))


def test_grpc_json_schema_is_compiled_at_the_router():
    assert json.loads(decode_request(grpc_request(json.dumps(PERSON)), None).sampling.json_schema) == PERSON
    bad = {"type": "object", "properties": {"age": {"type": "string", "format": "bogus"}}}
    assert refused(decode_request, grpc_request(json.dumps(bad)), None).field == "sampling.json_schema.properties.age"
    assert refused(decode_request, grpc_request("{not json"), None).field == "sampling.json_schema"
    assert refused(decode_request, grpc_request(json.dumps(PERSON), ignore_eos=True), None).field == "sampling.ignore_eos"
