"""Structured outputs beyond JSON: vLLM's structured_outputs (regex, choice, grammar, json,
json_object) and its older guided_* fields on the HTTP front, sampling.regex / choice / grammar
over gRPC, through every hop's conversion: compiled at the router, one that cannot be compiled
refused naming the field as sent, at most one kind a request."""
from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from services.common.grammar import ANY_OBJECT, MAX_CHOICES, MAX_GUIDE_CHARS, check_guide, grammar_for
from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.common.step import SamplingParams
from services.common.wire import engine_sampling, sampling_from_engine, sampling_from_request
from services.router.openai_api.generation import http_param
from services.router.openai_api.request import COMPLETION, parse_openai
from services.router.validation import decode_request
from tests.unit.test_structured_requests import chat, refused

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
SQL_GBNF = 'root ::= "SELECT " col " FROM " tbl\ncol ::= "id" | "name"\ntbl ::= "users" | "orders"'
YES_NO_LARK = 'start: "yes" | "no"'


@pytest.mark.parametrize("sent, field, value", [
    ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, "regex", r"\d{3}-\d{4}"),
    ({"guided_regex": r"\d{3}-\d{4}"}, "regex", r"\d{3}-\d{4}"),
    ({"structured_outputs": {"choice": ["positive", "negative"]}}, "choice", ["positive", "negative"]),
    ({"guided_choice": ["positive", "negative"]}, "choice", ["positive", "negative"]),
    ({"structured_outputs": {"grammar": SQL_GBNF}}, "grammar", SQL_GBNF),
    ({"guided_grammar": YES_NO_LARK}, "grammar", YES_NO_LARK),
    ({"structured_outputs": {"json": PERSON}}, "json_schema", json.dumps(PERSON, separators=(",", ":"))),
    ({"structured_outputs": {"json": json.dumps(PERSON)}}, "json_schema", json.dumps(PERSON, separators=(",", ":"))),
    ({"guided_json": PERSON}, "json_schema", json.dumps(PERSON, separators=(",", ":"))),
    ({"structured_outputs": {"json_object": True}}, "json_schema", ANY_OBJECT),
])
def test_each_kind_becomes_its_sampling_field_on_both_endpoints(sent, field, value):
    for request in (chat(**sent), parse_openai(COMPLETION, json.dumps({"model": "m", "prompt": "x", **sent}).encode())):
        s = request.body.sampling
        assert (list(getattr(s, field)) if field == "choice" else getattr(s, field)) == value
        assert [name for name in ("json_schema", "regex", "choice", "grammar") if getattr(s, name)] == [field]
        assert request.schema_field == next(iter(sent)) + (f".{next(iter(sent['structured_outputs']))}"
                                                           if "structured_outputs" in sent else "")


def test_nothing_asked_is_no_constraint():
    for sent in ({"structured_outputs": {"json_object": False}}, {"structured_outputs": {"regex": None}},
                 {"structured_outputs": {}}, {"guided_regex": None}, {"response_format": {"type": "text"}}):
        request = chat(**sent)
        assert not SamplingParams(**_guides(request.body.sampling)).constrained and request.schema_field == ""


def _guides(s) -> dict:
    return dict(json_schema=s.json_schema, regex=s.regex, choice=tuple(s.choice), grammar=s.grammar)


@pytest.mark.parametrize("sent, field, says", [
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "unclosed group"),
    ({"guided_regex": "[a-"}, "guided_regex", "unclosed character class"),
    ({"structured_outputs": {"grammar": "root ::= ::="}}, "structured_outputs.grammar", "Expected name"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar", "missing"),
    ({"guided_grammar": "start: x"}, "guided_grammar", "unknown name"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "empty"),
    ({"structured_outputs": {"regex": 7}}, "structured_outputs.regex", "string"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice", "non-empty list"),
    ({"guided_choice": ["yes", 2]}, "guided_choice[1]", "string"),
    ({"structured_outputs": {"choice": ["x"] * (MAX_CHOICES + 1)}}, "structured_outputs.choice", "at most"),
    ({"structured_outputs": {"regex": "a" * (MAX_GUIDE_CHARS + 1)}}, "structured_outputs.regex", "at most"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "objekt"}}}}},
     "structured_outputs.json.properties.a", "objekt"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "true or false"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "not supported"),
    ({"structured_outputs": "regex"}, "structured_outputs", "an object"),
])
def test_what_cannot_be_served_is_refused_naming_the_field_as_sent(sent, field, says):
    error = refused(chat, **sent)
    assert error.field == field and says in error.message, (error.field, error.message)


@pytest.mark.parametrize("sent, second", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_json": PERSON, "guided_choice": ["a"]}, "guided_choice"),
])
def test_two_answers_asked_for_are_a_400_naming_the_second(sent, second):
    error = refused(chat, **sent)
    assert error.field == second and "both say what the answer is" in error.message


def test_ignore_eos_and_a_forced_tool_call_cannot_come_with_one():
    assert refused(chat, guided_choice=["a", "b"], ignore_eos=True).field == "ignore_eos"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    error = refused(chat, structured_outputs={"regex": "a+"}, tools=tools, tool_choice="required")
    assert error.field == "tool_choice" and "structured_outputs.regex" in error.message
    assert chat(structured_outputs={"regex": "a+"}, tools=tools).body.sampling.regex == "a+"     # "auto" is fine


def test_the_schedulers_errors_name_the_field_as_sent():
    """The scheduler compiles again with the tokenizer and names sampling.*: the HTTP answer names
    the body's field the client used."""
    assert http_param("sampling.regex", chat(guided_regex="a+")) == "guided_regex"
    assert http_param("sampling.choice", chat(structured_outputs={"choice": ["a"]})) == "structured_outputs.choice"
    assert http_param("sampling.json_schema.properties.a", chat(structured_outputs={"json": PERSON})) == \
        "structured_outputs.json.properties.a"
    assert http_param("sampling.grammar", chat()) == "grammar"


def grpc_request(**sampling) -> router_pb2.GenerateRequestBytes:
    return router_pb2.GenerateRequestBytes(prompt=b"Hi", sampling=common_pb2.SamplingParams(**sampling))


def test_grpc_fields_are_compiled_at_the_router():
    assert decode_request(grpc_request(regex=r"\d+"), None).sampling.regex == r"\d+"
    assert list(decode_request(grpc_request(choice=["a", "b"]), None).sampling.choice) == ["a", "b"]
    assert decode_request(grpc_request(grammar=SQL_GBNF), None).sampling.grammar == SQL_GBNF
    assert refused(decode_request, grpc_request(regex="("), None).field == "sampling.regex"
    assert refused(decode_request, grpc_request(grammar="start: x"), None).field == "sampling.grammar"
    assert refused(decode_request, grpc_request(regex="a", choice=["a"]), None).field == "sampling.choice"
    assert refused(decode_request, grpc_request(json_schema='{"type": "object"}', grammar=YES_NO_LARK),
                   None).field == "sampling.grammar"
    assert refused(decode_request, grpc_request(choice=["a"], ignore_eos=True), None).field == "sampling.ignore_eos"


def test_every_hop_carries_the_kind_and_the_engine_compiles_it():
    client = common_pb2.SamplingParams(choice=["yes", "no"])
    ours = sampling_from_request(client, 8)
    assert ours.choice == ("yes", "no") and ours.constrained
    assert sampling_from_engine(engine_sampling(ours)) == ours
    for sampling in (ours, SamplingParams(regex="a+"), SamplingParams(grammar=SQL_GBNF),
                     SamplingParams(json_schema=ANY_OBJECT)):
        assert LLMatcher.validate_grammar(grammar_for(sampling)) == ""   # llguidance's grammar, as the worker builds it
    with pytest.raises(ValueError, match="choice and regex both say"):
        SamplingParams(regex="a+", choice=("a",))
    with pytest.raises(ValueError, match="min_tokens cannot be combined with grammar"):
        SamplingParams(grammar=YES_NO_LARK, min_tokens=1)
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with regex"):
        SamplingParams(regex="a+", ignore_eos=True)


def test_check_guide_names_the_field_it_is_given_or_the_samplings():
    assert refused(check_guide, "(", (), "").field == "sampling.regex"
    assert refused(check_guide, "", (), "start: x", field="guided_grammar").field == "guided_grammar"
    check_guide("", ("é", 'a "quoted" \\ one', "line\nbreak"), "")     # JSON's escapes are Lark's


def test_a_guide_whose_first_mask_needs_more_than_a_step_allows_is_refused(text_tokenizer):
    """The scheduler computes each structured output's first mask under the workers' fuel
    (services/common/grammar.py FIRST_MASK_FUEL) before admitting it."""
    from services.common.errors import ServiceError
    from services.common.grammar import check_admissible
    from services.common.token_bytes import byte_table
    table = byte_table(text_tokenizer)
    for sampling in (common_pb2.SamplingParams(regex="[0-9]{4}-[0-9]{2}"), common_pb2.SamplingParams(choice=["a", "b"]),
                     common_pb2.SamplingParams(json_schema=ANY_OBJECT), common_pb2.SamplingParams(regex="(a{60}){60}")):
        check_admissible(sampling, table)
    with pytest.raises(ServiceError) as refused:
        check_admissible(common_pb2.SamplingParams(regex="(a{600}){600}"), table)
    assert refused.value.field == "sampling.regex" and "too many expressions" in refused.value.message
