"""OpenAI request bodies -> our request, and our chunks -> OpenAI's response objects (pure)."""
from __future__ import annotations

import json

import pytest

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import HIGH, LOW, MEDIUM
from services.common.proto.qos.v1 import common_pb2
from services.router.openai_api.service_class import class_header
from services.router.openai_api.request import CHAT, COMPLETION, parse_openai
from services.router.openai_api.response import OpenAIResponse, error_body

MESSAGES = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return parse_openai(CHAT, json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode())


def refused(kind: str, raw: bytes) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        parse_openai(kind, raw)
    assert caught.value.kind is ErrorKind.INVALID
    return caught.value


def test_a_chat_request_maps_to_ours():
    r = chat(max_completion_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop="END", top_k=-1,
             stream=True, stream_options={"include_usage": True}, service_tier="flex", user="u1",
             presence_penalty=0, logprobs=False, tools=[], response_format={"type": "text"})
    s = r.body.sampling
    assert (s.max_tokens, s.temperature, s.seed, list(s.stop), s.top_k) == (7, 0.5, 3, ["END"], 0)
    assert abs(s.top_p - 0.9) < 1e-6
    assert (r.stream, r.include_usage, r.tier, r.user, r.max_tokens_field) == \
        (True, True, LOW, "u1", "max_completion_tokens")
    assert [(m.role, m.content) for m in r.body.messages] == [("user", "Hi")]


def test_content_parts_and_the_developer_role():
    r = chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "Be "},
                                                         {"type": "text", "text": "brief."}]},
                       {"role": "assistant", "content": None}, {"role": "user", "content": "Hi"}])
    assert [(m.role, m.content) for m in r.body.messages] == [("system", "Be brief."), ("assistant", ""),
                                                             ("user", "Hi")]


def test_completions_default_to_16_tokens_as_openai_does_and_take_one_prompt():
    r = parse_openai(COMPLETION, b'{"model": "m", "prompt": ["Once"]}')
    assert (r.body.prompt, r.body.sampling.max_tokens, r.tier) == ("Once", 16, None)
    assert not parse_openai(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}') \
        .body.sampling.HasField("max_tokens")


@pytest.mark.parametrize("tier, priority", [("priority", HIGH), ("default", MEDIUM), ("auto", MEDIUM),
                                            ("flex", LOW)])
def test_service_tiers(tier, priority):
    assert chat(service_tier=tier).tier == priority


# vLLM's priority: lower is sooner, 0 its default; only the sign carries over.
@pytest.mark.parametrize("priority, served", [(-(2**63), HIGH), (-1, HIGH), (0, None), (1, LOW),
                                              (2**63 - 1, LOW)])
def test_vllm_priority_maps_by_its_sign(priority, served):
    assert chat(priority=priority).tier == served
    assert parse_openai(COMPLETION, json.dumps({"model": "m", "prompt": "x", "priority": priority}).encode()
                        ).tier == served


@pytest.mark.parametrize("fields, served", [
    ({"priority": -5, "service_tier": "priority"}, HIGH),
    ({"priority": 3, "service_tier": "flex"}, LOW),
    ({"priority": 0, "service_tier": "flex"}, LOW),          # 0 asks for nothing
    ({"priority": 0, "service_tier": "priority"}, HIGH),
    ({"priority": None, "service_tier": "default"}, MEDIUM),
])
def test_priority_and_service_tier_that_agree(fields, served):
    assert chat(**fields).tier == served


@pytest.mark.parametrize("fields", [{"priority": -1, "service_tier": "default"},
                                    {"priority": -1, "service_tier": "flex"},
                                    {"priority": 1, "service_tier": "auto"},
                                    {"priority": 2, "service_tier": "priority"}])
def test_priority_and_service_tier_that_differ_are_a_400_naming_priority(fields):
    error = refused(CHAT, json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode())
    assert error.field == "priority" and "send one of them" in error.message


@pytest.mark.parametrize("value, words", [(1.5, "integer, got number"), (True, "integer, got boolean"),
                                          ("-1", "integer, got string"), (2**63, "must be in")])
def test_a_priority_that_is_no_integer_is_a_400_naming_it(value, words):
    error = refused(CHAT, json.dumps({"model": "m", "messages": MESSAGES, "priority": value}).encode())
    assert error.field == "priority" and words in error.message


@pytest.mark.parametrize("fields, header, sent", [
    ({}, None, None),                                  # neither: the default class
    ({}, "Low", "Low"),                                # the header alone
    ({"priority": -1}, None, "high"),                  # the body alone
    ({"service_tier": "flex"}, None, "low"),
    ({"priority": 0}, "low", "low"),                   # 0 asks for nothing
    ({"priority": -1}, " HIGH ", " HIGH "),            # agreeing, in the header's spelling
    ({"service_tier": "auto"}, "medium", "medium"),
    ({"priority": 1}, "urgent", "urgent"),             # no class: refused where headers are read
])
def test_the_class_header_the_request_goes_on_with(fields, header, sent):
    assert class_header(chat(**fields), header) == sent


@pytest.mark.parametrize("fields, header, field", [
    ({"priority": -1}, "low", "priority"),
    ({"priority": 5}, "medium", "priority"),
    ({"service_tier": "priority"}, "low", "service_tier"),
    ({"service_tier": "flex"}, "HIGH", "service_tier"),
    ({"priority": 0, "service_tier": "default"}, "high", "service_tier"),
])
def test_a_body_class_that_differs_from_x_priority_is_a_400_naming_the_field(fields, header, field):
    with pytest.raises(ServiceError) as caught:
        class_header(chat(**fields), header)
    error = caught.value
    assert error.kind is ErrorKind.INVALID and error.field == field and "x-priority header" in error.message


@pytest.mark.parametrize("raw, field, words", [
    (b"", "body", "empty"),
    (b"{", "body", "not valid JSON"),
    (b'"text"', "body", "must be a JSON object, got string"),
    (b"[" * 50_000 + b"]" * 50_000, "body", "nested too deeply"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}', "body", "not valid JSON"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content",
     "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "model", "model is required"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x", "name": "bob"}]}',
     "messages[0].name", "not supported"),
    (b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "messages[0].role", "robot"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
     "messages[0].content[0]", "only text"),
    (b'{"model": "m", "messages": [{"role": "user", "content": ""}]}', "messages", "all empty"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     "temperature", "finite"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 1e999}',
     "temperature", "finite"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, '
     b'"max_completion_tokens": 6}', "max_completion_tokens", "differ"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {}}',
     "stream_options", "only allowed with stream: true"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": true}',
     "max_tokens", "integer, got boolean"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": true}',
     "echo", "not supported"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "min_tokens": -1}',
     "min_tokens", "must be"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": 2.5}',
     "frequency_penalty", "must be in [-2, 2]"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"-3": 1}}',
     "logit_bias", "keys must be token ids"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "y"}', "prompt",
     "unknown field"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", ""]}', "stop[1]",
     "must not be empty"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": "' + b"x" * 1025 + b'"}',
     "stop", "1025 characters long, at most 1024"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "' + b"\xc3\xa9" * 1025
     + b'"]}', "stop[1]", "1025 characters long, at most 1024"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": 18446744073709551616}',
     "seed", "must be in 0..18446744073709551615"),
])
def test_refusals_name_the_parameter(raw, field, words):
    error = refused(CHAT, raw)
    assert error.field == field and words in error.message


def test_a_stop_string_of_1024_characters_is_taken():
    r = parse_openai(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["'
                     + "é".encode() * 1024 + b'"]}')
    assert list(r.body.sampling.stop) == ["é" * 1024]


def chunk(text: str, finish: int = 0, prompt: int = 3, completion: int = 2) -> common_pb2.GenerateChunk:
    c = common_pb2.GenerateChunk(text=text, finish_reason=finish)
    if finish:
        c.usage.prompt_tokens, c.usage.completion_tokens = prompt, completion
    return c


def test_chat_stream_events_role_first_finish_last_usage_alone():
    out = OpenAIResponse(chat(stream=True, stream_options={"include_usage": True}), "abc", 7, HIGH)
    events = out.events(0, chunk("Hel")) + out.events(0, chunk("lo", common_pb2.FINISH_REASON_LENGTH))
    assert [e["choices"][0]["delta"] if e["choices"] else None for e in events] == \
        [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}, None]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, None, "length"]
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(e["usage"] is None for e in events[:-1])
    assert {(e["id"], e["object"], e["service_tier"]) for e in events} == \
        {("chatcmpl-abc", "chat.completion.chunk", "priority")}


def test_continuous_usage_stats_give_every_chunk_its_choices_tokens_so_far():
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage is its choice's prompt and
    the tokens it streamed so far; the last chunk's counts are the scheduler's; the usage chunk
    after the last choice stays the request's whole."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    out = OpenAIResponse(chat(n=2, stream=True, stream_options=options), "abc", 7, HIGH)
    first = common_pb2.GenerateChunk(text="He", token_ids=[5, 6])
    first.usage.prompt_tokens = 3
    events = out.events(0, first) + out.events(0, common_pb2.GenerateChunk(text="l", token_ids=[7])) + \
        out.events(1, chunk("x", common_pb2.FINISH_REASON_STOP, prompt=3, completion=1)) + \
        out.events(0, chunk("lo", common_pb2.FINISH_REASON_LENGTH, prompt=3, completion=4))
    so_far = [(e["choices"][0]["index"], e["usage"]["completion_tokens"]) for e in events if e["choices"]]
    assert so_far == [(0, 2), (0, 2), (0, 3), (1, 1), (1, 1), (1, 1), (0, 4), (0, 4)]   # role, text, finish
    assert all(e["usage"]["prompt_tokens"] == 3 for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    for options in ({"continuous_usage_stats": True}, {"include_usage": True, "continuous_usage_stats": 1}):
        body = {"model": "m", "messages": MESSAGES, "stream": True, "stream_options": options}
        assert refused(CHAT, json.dumps(body).encode()).field == "stream_options.continuous_usage_stats"


def test_a_whole_completion_body():
    out = OpenAIResponse(parse_openai(COMPLETION, b'{"model": "m", "prompt": "x"}'), "id1", 7, LOW)
    out.add(0, chunk("a"))
    out.add(0, chunk("b", common_pb2.FINISH_REASON_STOP))
    body = out.body()
    assert body["object"] == "text_completion" and body["service_tier"] == "flex"
    assert body["choices"] == [{"index": 0, "text": "ab", "finish_reason": "stop", "logprobs": None,
                                "stop_reason": None}]


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice():
    """vLLM's stop_reason: the stop string, else a stop token the request named, else None (EOS,
    length); on the whole body's choice and on a stream's finishing object."""
    request = b'{"model": "m", "prompt": "x", "stop": ["."], "stop_token_ids": [7]}'
    for stop_string, token, expected in ((".", 5, "."), ("", 7, 7), ("", 2, None)):
        last = chunk("b", common_pb2.FINISH_REASON_STOP)
        last.stop_string = stop_string
        last.token_ids.append(token)
        whole = OpenAIResponse(parse_openai(COMPLETION, request), "id1", 7, LOW)
        whole.add(0, last)
        assert whole.body()["choices"][0]["stop_reason"] == expected, (stop_string, token)
        streamed = OpenAIResponse(parse_openai(COMPLETION, request.replace(b"}", b', "stream": true}')), "id1", 7, LOW)
        events = streamed.events(0, last)
        assert events[-1]["choices"][0]["stop_reason"] == expected
        assert all("stop_reason" not in e["choices"][0] for e in events[:-1])
    cut = chunk("b", common_pb2.FINISH_REASON_LENGTH)
    cut.token_ids.append(7)                  # a stop token's id, but the length ended it
    whole = OpenAIResponse(parse_openai(COMPLETION, request), "id1", 7, LOW)
    whole.add(0, cut)
    assert whole.body()["choices"][0]["stop_reason"] is None


def test_n_choices_in_one_body_and_in_a_stream_with_the_usage_once():
    whole = OpenAIResponse(chat(n=2), "abc", 7, HIGH)
    whole.add(1, chunk("b", common_pb2.FINISH_REASON_STOP, prompt=3, completion=1))
    whole.add(0, chunk("a"))
    whole.add(0, chunk("c", common_pb2.FINISH_REASON_LENGTH, prompt=3, completion=2))
    assert whole.finished
    body = whole.body()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ac", "length"), (1, "b", "stop")]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    streamed = OpenAIResponse(chat(n=2, stream=True, stream_options={"include_usage": True}), "abc", 7, HIGH)
    first = streamed.events(0, chunk("a", common_pb2.FINISH_REASON_STOP, completion=1))
    assert not streamed.finished and all(e["choices"] for e in first)       # no usage before choice 1 ends
    events = first + streamed.events(1, chunk("b", common_pb2.FINISH_REASON_STOP, completion=4))
    assert [e["choices"][0]["index"] for e in events[:-1]] == [0, 0, 0, 1, 1, 1]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_a_completion_prompt_is_text_token_ids_or_a_batch_of_either():
    def prompts(value):
        r = parse_openai(COMPLETION, json.dumps({"model": "m", "prompt": value, "n": 2}).encode())
        return r.prompts, r.body.prompt, list(r.body.prompt_token_ids), r.choices

    assert prompts("hi") == (["hi"], "hi", [], 2)
    assert prompts([7, 8, 9]) == ([[7, 8, 9]], "", [7, 8, 9], 2)
    assert prompts(["a", "b", "c"]) == (["a", "b", "c"], "a", [], 6)
    assert prompts([[1], [2, 3]]) == ([[1], [2, 3]], "", [1], 4)
    for value, param in (([], "prompt"), (["a", 3], "prompt[1]"), ([[1], "b"], "prompt[1]"), ([[1], []], "prompt[1]"),
                         ([1, -2], "prompt[1]"), ([[1, 2.5]], "prompt[0][1]"), ([1, True], "prompt[1]"),
                         (["a", ""], "prompt[1]"), ([None], "prompt[0]"), ({"a": 1}, "prompt")):
        assert refused(COMPLETION, json.dumps({"model": "m", "prompt": value}).encode()).field == param, value
    # 64 choices at most in one request, n for each prompt
    assert refused(COMPLETION, json.dumps({"model": "m", "prompt": ["a"] * 65}).encode()).field == "prompt"
    assert refused(COMPLETION, json.dumps({"model": "m", "prompt": ["a"] * 5, "n": 13}).encode()).field == "n"
    assert parse_openai(COMPLETION, json.dumps({"model": "m", "prompt": ["a"] * 4, "n": 16}).encode()).choices == 64


def test_a_batchs_usage_counts_each_prompt_once():
    out = OpenAIResponse(parse_openai(COMPLETION, b'{"model": "m", "prompt": ["a", "bb"], "n": 2}'), "r", 7, LOW)
    for index, prompt in ((0, 3), (1, 3), (2, 5), (3, 5)):
        out.add(index, chunk(f"t{index}", common_pb2.FINISH_REASON_STOP, prompt=prompt, completion=1))
    body = out.body()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 8 and body["usage"]["completion_tokens"] == 4


def test_n_is_1_to_16():
    assert chat(n=16).n == 16 and chat().n == 1
    for n in (0, 17, "2", 2.5, True):
        assert refused(CHAT, json.dumps({"model": "m", "messages": MESSAGES, "n": n}).encode()).field == "n"


def test_error_body_shape():
    error = ServiceError(ErrorKind.EXHAUSTED, "queue full", retry_after_ms=10, reason="queue_full")
    assert error_body(error, None) == {"error": {"message": "queue full", "type": "rate_limit_error",
                                                 "param": None, "code": "queue_full"}}


def test_an_assistant_turn_echoed_from_an_openai_response_is_taken():
    """OpenAI's responses carry refusal: null, annotations: [], audio: null, function_call: null;
    a client that sends its history back sends them too (a 400 naming messages[1].refusal)."""
    echoed = {"role": "assistant", "content": "Hello!", "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": None}
    r = chat(messages=MESSAGES + [echoed, {"role": "user", "content": "And?", "name": None}])
    assert [(m.role, m.content) for m in r.body.messages] == [("user", "Hi"), ("assistant", "Hello!"), ("user", "And?")]
    for key, value in (("refusal", "I can't"), ("annotations", [{"type": "url_citation"}]), ("name", "bob")):
        with pytest.raises(ServiceError) as caught:
            chat(messages=MESSAGES + [{**echoed, key: value}])
        assert caught.value.field == f"messages[1].{key}"


def test_an_error_message_names_the_field_as_the_client_sent_it():
    """HTTP answered 'sampling.max_tokens=10000 does not fit ...; lower sampling.max_tokens' with
    param max_completion_tokens: the message spoke of a gRPC request the client never sent."""
    from services.router.openai_api.generation import http_param
    request = chat(max_completion_tokens=10_000)
    error = ServiceError(ErrorKind.INVALID, "sampling.max_tokens=10000 does not fit: ... lower sampling.max_tokens",
                         field="sampling.max_tokens")
    body = error_body(error, http_param(error.field, request))["error"]
    assert body == {**body, "param": "max_completion_tokens",
                    "message": "max_completion_tokens=10000 does not fit: ... lower max_completion_tokens"}
    plain = ServiceError(ErrorKind.INVALID, "prompt is empty", field="prompt")     # not a sampling field: as is
    assert error_body(plain, "messages")["error"]["message"] == "prompt is empty"


def prompt_chunk() -> common_pb2.GenerateChunk:
    """A first chunk carrying three prompt tokens' entries (the first with no logprob), 3 top each."""
    c = common_pb2.GenerateChunk(text="!", token_ids=[9], finish_reason=common_pb2.FINISH_REASON_LENGTH)
    c.usage.prompt_tokens, c.usage.completion_tokens = 3, 1
    c.prompt_logprobs.add(token_id=1, logprob=float("nan"), token_bytes=b"A")
    for token, logprob, rank in ((2, -1.5, 2), (3, -0.25, 1)):
        c.prompt_logprobs.add(token_id=token, logprob=logprob, rank=rank, token_bytes=bytes([64 + token]), top=[
            common_pb2.TopLogprob(token_id=t, logprob=lp, token_bytes=bytes([64 + t]))
            for t, lp in ((3, -0.25), (2, -1.5), (7, -2.0))])
    return c


def test_vllm_prompt_logprobs_on_both_endpoints():
    """vLLM's prompt_logprobs N: completions' choices and chat's response carry, for each prompt
    token after the first, its own entry (logprob, rank, decoded_token) and the N most likely."""
    completion = parse_openai(COMPLETION, b'{"model": "m", "prompt": "x", "prompt_logprobs": 1}')
    assert completion.prompt_logprobs == 1 and completion.body.sampling.prompt_logprobs == 1
    out = OpenAIResponse(completion, "abc", 7, HIGH)
    out.add(0, prompt_chunk())
    assert out.body()["choices"][0]["prompt_logprobs"] == [
        None,
        {"2": {"logprob": -1.5, "rank": 2, "decoded_token": "B"},
         "3": {"logprob": -0.25, "rank": 1, "decoded_token": "C"}},
        {"3": {"logprob": -0.25, "rank": 1, "decoded_token": "C"}}]
    talk = OpenAIResponse(chat(prompt_logprobs=0), "abc", 7, HIGH)
    talk.add(0, prompt_chunk())
    body = talk.body()
    assert [list(p) if p else p for p in body["prompt_logprobs"]] == [None, ["2"], ["3"]]
    assert "prompt_logprobs" not in body["choices"][0]
    plain = OpenAIResponse(chat(), "abc", 7, HIGH)
    plain.add(0, prompt_chunk())
    assert "prompt_logprobs" not in plain.body() and "prompt_logprobs" not in plain.body()["choices"][0]


def test_echo_keeps_its_own_top_count_beside_more_prompt_logprobs():
    both = parse_openai(COMPLETION, b'{"model": "m", "prompt": "x", "echo": true, "logprobs": 1, "prompt_logprobs": 3}')
    assert both.body.sampling.prompt_logprobs == 3 and both.body.sampling.logprobs == 1
    out = OpenAIResponse(both, "abc", 7, HIGH)
    out.add(0, prompt_chunk())
    choice = out.body()["choices"][0]
    assert [len(top) for top in choice["logprobs"]["top_logprobs"][1:3]] == [2, 1]   # its one, and the chosen
    assert len(choice["prompt_logprobs"][1]) == 3        # the token's own and the three likeliest (one is it)


@pytest.mark.parametrize("raw", [b'"prompt_logprobs": 21', b'"prompt_logprobs": "2"', b'"prompt_logprobs": true',
                                 b'"prompt_logprobs": -1', b'"prompt_logprobs": 2, "stream": true'])
def test_a_bad_prompt_logprobs_is_a_400_naming_it(raw):
    assert refused(COMPLETION, b'{"model": "m", "prompt": "x", ' + raw + b'}').field == "prompt_logprobs"


VLLM_DEFAULTS = {"use_beam_search": False, "length_penalty": 1.0, "include_stop_str_in_output": False,
                 "skip_special_tokens": True, "spaces_between_special_tokens": True,
                 "return_tokens_as_token_ids": False, "add_generation_prompt": True,
                 "continue_final_message": False, "truncate_prompt_tokens": None, "chat_template": None}


def test_vllm_extras_at_their_defaults_are_taken_and_anything_else_named():
    """Clients written for vLLM send its extra parameters at their defaults, which is what we do;
    another value is a 400 naming the parameter, never ignored."""
    for kind, body in ((CHAT, {"model": "m", "messages": MESSAGES}), (COMPLETION, {"model": "m", "prompt": "x"})):
        parse_openai(kind, json.dumps({**body, **VLLM_DEFAULTS}).encode())
    for kind, name, other in ((CHAT, "use_beam_search", True), (CHAT, "length_penalty", 0.8),
                              (CHAT, "chat_template", "{{ messages }}"), (COMPLETION, "add_generation_prompt", False),
                              (COMPLETION, "continue_final_message", True), (COMPLETION, "chat_template_kwargs", {"a": 1})):
        body = {"model": "m", **({"messages": MESSAGES} if kind == CHAT else {"prompt": "x"}), name: other}
        error = refused(kind, json.dumps(body).encode())
        assert error.field == name and "not supported" in error.message


def test_echo_with_max_tokens_0_asks_for_the_prompt_alone():
    """OpenAI's legacy scoring call: the model computes one token, which the router drops
    (request_path.drop_answer): no text, no logprob, no completion token billed, "length"."""
    from services.router.request_path import drop_answer
    scoring = parse_openai(COMPLETION, b'{"model": "m", "prompt": "x", "echo": true, "logprobs": 1, "max_tokens": 0}')
    assert scoring.prompt_only and scoring.body.sampling.max_tokens == 1
    assert refused(COMPLETION, b'{"model": "m", "prompt": "x", "max_tokens": 0}').field == "max_tokens"
    last = common_pb2.GenerateChunk(text="!", token_ids=[9], finish_reason=common_pb2.FINISH_REASON_STOP)
    last.logprobs.add(token_id=9, logprob=-0.5)
    last.usage.prompt_tokens, last.usage.completion_tokens = 3, 1
    drop_answer(last)
    assert (last.text, list(last.token_ids), len(last.logprobs)) == ("", [], 0)
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == 0
    assert last.usage.prompt_tokens == 3
