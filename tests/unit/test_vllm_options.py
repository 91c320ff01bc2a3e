"""vLLM's extra request fields that change what is generated or shown (services/router/
vllm_options.py, services/common/chat_options.py, services/scheduler/prompt_intake.py): read on
the HTTP and gRPC fronts, refused by name when wrong, and applied where the prompt is made."""
from __future__ import annotations

import json

import pytest

from services.common.chat_options import MAX_KWARGS_BYTES, ChatRender
from services.common.errors import ServiceError
from services.common.priority import HIGH
from services.common.proto.qos.v1 import common_pb2, router_pb2, scheduler_pb2
from services.common.step import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, SamplingParams
from services.common.tokenizer import ChatTemplate
from services.common.wire import engine_sampling, sampling_from_engine
from services.router.openai_api.generation import http_param
from services.router.openai_api.logprobs import LogprobsView
from services.router.openai_api.request import CHAT, COMPLETION, parse_openai
from services.router.openai_api.response import OpenAIResponse
from services.router.validation import check_sampling, decode_request
from services.scheduler.prompt_intake import check_allowed, forbidden, tokenized, truncated

CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "Write a story"},
                                        {"role": "assistant", "content": "Once upon"}]}


def chat(**fields):
    return parse_openai(CHAT, json.dumps({**CHAT_BODY, **fields}).encode())


def refused(call, *args, **kwargs) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        call(*args, **kwargs)
    return caught.value


def test_each_field_reaches_the_request_on_both_endpoints():
    request = chat(include_stop_str_in_output=True, skip_special_tokens=False, truncate_prompt_tokens=-1,
                   allowed_token_ids=[5, 7], return_tokens_as_token_ids=True, add_generation_prompt=False,
                   continue_final_message=True, chat_template_kwargs={"enable_thinking": False})
    s = request.body.sampling
    assert s.include_stop_str_in_output and s.HasField("skip_special_tokens") and not s.skip_special_tokens
    assert s.truncate_prompt_tokens == -1 and list(s.allowed_token_ids) == [5, 7] and request.tokens_as_ids
    options = request.body.chat_template
    assert options.HasField("add_generation_prompt") and not options.add_generation_prompt
    assert options.continue_final_message and json.loads(options.kwargs_json) == {"enable_thinking": False}
    completion = parse_openai(COMPLETION, json.dumps({"model": "m", "prompt": "x", "truncate_prompt_tokens": 3,
                                                      "allowed_token_ids": [1]}).encode())
    assert completion.body.sampling.truncate_prompt_tokens == 3
    echoed = {"model": "m", "prompt": "x", "echo": True, "truncate_prompt_tokens": 3}
    assert refused(parse_openai, COMPLETION, json.dumps(echoed).encode()).field == "truncate_prompt_tokens"
    # Unset, nothing changes: the defaults are what the proto's absence means.
    plain = chat()
    assert not plain.body.sampling.HasField("skip_special_tokens") and not plain.body.HasField("chat_template")


@pytest.mark.parametrize("fields, param", [
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"return_tokens_as_token_ids": None, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [0] * (MAX_ALLOWED_TOKEN_IDS + 1)}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids[1]"),
    ({"allowed_token_ids": [3, "4"]}, "allowed_token_ids[1]"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": {"x": "y" * MAX_KWARGS_BYTES}}, "chat_template_kwargs"),
])
def test_a_wrong_value_is_refused_naming_its_field(fields, param):
    assert refused(chat, **fields).field == param


def test_a_lone_surrogate_in_the_template_variables_is_refused():
    raw = json.dumps(CHAT_BODY)[:-1] + ', "chat_template_kwargs": {"name": "\\ud800"}}'
    assert refused(parse_openai, CHAT, raw.encode()).field == "chat_template_kwargs"


def test_continue_final_message_alone_leaves_the_generation_prompt_off():
    """Unset add_generation_prompt with continue_final_message: rendered as vLLM renders the pair
    false/true (transformers refuses both true), the friendlier reading of what was asked."""
    from services.common.chat_options import chat_render
    options = chat(continue_final_message=True).body.chat_template
    assert chat_render(options) == ChatRender(add_generation_prompt=False, continue_final_message=True)


def test_the_schedulers_field_names_are_the_bodys():
    assert http_param("chat_template.kwargs_json", None) == "chat_template_kwargs"
    assert http_param("chat_template.continue_final_message", None) == "continue_final_message"
    assert http_param("sampling.truncate_prompt_tokens", chat()) == "truncate_prompt_tokens"


def test_grpc_takes_the_options_with_messages_only():
    raw = router_pb2.GenerateRequestBytes(messages=[router_pb2.ChatMessageBytes(role=b"user", content=b"hi")])
    raw.chat_template.continue_final_message = True
    raw.chat_template.kwargs_json = b'{"enable_thinking": true}'
    typed = decode_request(raw, 2048)
    assert typed.chat_template.continue_final_message and not typed.chat_template.HasField("add_generation_prompt")
    prompt_only = router_pb2.GenerateRequestBytes(prompt=b"hi")
    prompt_only.chat_template.continue_final_message = True
    assert refused(decode_request, prompt_only, 2048).field == "chat_template"
    raw.chat_template.kwargs_json = b'{"tools": "\xff"}'
    assert refused(decode_request, raw, 2048).field == "chat_template.kwargs_json"
    raw.chat_template.kwargs_json = b'{"tools": []}'
    assert refused(decode_request, raw, 2048).field == "chat_template.kwargs_json.tools"
    raw.chat_template.kwargs_json = b""
    raw.chat_template.add_generation_prompt = True
    assert refused(decode_request, raw, 2048).field == "chat_template.continue_final_message"


def test_grpc_holds_truncation_to_the_context_window():
    for keep, ok in ((-1, True), (1, True), (2048, True), (0, False), (-3, False), (2049, False)):
        s = common_pb2.SamplingParams(truncate_prompt_tokens=keep)
        if ok:
            check_sampling(s, 2048)
        else:
            assert refused(check_sampling, s, 2048).field == "sampling.truncate_prompt_tokens"


def test_truncation_keeps_the_last_tokens():
    ids = list(range(100))
    assert truncated(ids, common_pb2.SamplingParams(), 64) == ids
    assert truncated(ids, common_pb2.SamplingParams(truncate_prompt_tokens=10), 2048) == ids[-10:]
    assert truncated(ids, common_pb2.SamplingParams(truncate_prompt_tokens=500), 2048) == ids
    # -1: what leaves room for max_tokens; unset, for the default (256) or half a small window.
    assert truncated(ids, common_pb2.SamplingParams(truncate_prompt_tokens=-1, max_tokens=40), 64) == ids[-24:]
    assert truncated(ids, common_pb2.SamplingParams(truncate_prompt_tokens=-1), 64) == ids[-32:]
    assert truncated(ids, common_pb2.SamplingParams(truncate_prompt_tokens=-1), 300) == ids
    for s in (common_pb2.SamplingParams(truncate_prompt_tokens=-1, max_tokens=64),
              common_pb2.SamplingParams(truncate_prompt_tokens=65)):
        assert refused(truncated, ids, s, 64).field == "sampling.truncate_prompt_tokens"


def test_allowed_tokens_are_the_models_and_can_begin_an_answer():
    check_allowed(common_pb2.SamplingParams(allowed_token_ids=[2, 9], min_tokens=3), 100, {2})
    assert refused(check_allowed, common_pb2.SamplingParams(allowed_token_ids=[2, 100]), 100, {2}).field \
        == "sampling.allowed_token_ids[1]"
    only_ends = common_pb2.SamplingParams(allowed_token_ids=[2, 9], stop_token_ids=[9], min_tokens=1)
    assert refused(check_allowed, only_ends, 100, {2}).field == "sampling.allowed_token_ids"
    only_ends.ignore_eos = True            # then the EOS id is an ordinary token
    check_allowed(only_ends, 100, {2})


def test_the_final_message_is_continued_and_template_variables_reach_the_template(text_tokenizer):
    submit = scheduler_pb2.SubmitRequest(messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"])
                                                   for m in CHAT_BODY["messages"]])
    reply = text_tokenizer.decode(tokenized(submit, text_tokenizer, "m"), skip_special_tokens=False)
    assert reply.endswith("Once upon<|im_end|>\n<|im_start|>assistant\n")
    submit.chat_template.continue_final_message = True
    continued = text_tokenizer.decode(tokenized(submit, text_tokenizer, "m"), skip_special_tokens=False)
    assert continued.endswith("<|im_start|>assistant\nOnce upon") and reply.startswith(continued)
    submit.chat_template.continue_final_message = False
    submit.chat_template.add_generation_prompt = False
    closed = text_tokenizer.decode(tokenized(submit, text_tokenizer, "m"), skip_special_tokens=False)
    assert closed.endswith("Once upon<|im_end|>\n")
    submit.messages[-1].content = "   "
    submit.chat_template.continue_final_message = True
    submit.chat_template.ClearField("add_generation_prompt")
    assert refused(tokenized, submit, text_tokenizer, "m").field == "chat_template.continue_final_message"
    template = ChatTemplate("{% if greet %}Hello, {% endif %}{{ messages[0]['content'] }}", None, None)
    assert template.render([{"role": "user", "content": "x"}], kwargs={"greet": True}) == "Hello, x"
    assert template.render([{"role": "user", "content": "x"}]) == "x"


def test_logprobs_name_tokens_by_id_when_asked():
    entry = common_pb2.TokenLogprob(token_id=42, logprob=-0.5, token_bytes=b"\xf0\x9f")
    entry.top.add(token_id=7, logprob=-1.0, token_bytes=b"a")
    content = LogprobsView(chat=True, as_ids=True).of([entry])["content"][0]
    assert content["token"] == "token_id:42" and content["bytes"] == [0xF0, 0x9F]
    assert content["top_logprobs"][0]["token"] == "token_id:7"
    legacy = LogprobsView(chat=False, as_ids=True).of([entry, entry])
    assert legacy["tokens"] == ["token_id:42"] * 2 and legacy["top_logprobs"][0] == {"token_id:7": -1.0,
                                                                                    "token_id:42": -0.5}
    assert legacy["text_offset"] == [0, 1]      # offsets stay the text's: one U+FFFD per partial character
    assert LogprobsView(chat=True).of([entry])["content"][0]["token"] == "\ufffd"


def test_bad_words_reach_the_request_and_are_checked_on_both_fronts():
    assert list(chat(bad_words=["Paris", " blue sky"]).body.sampling.bad_words) == ["Paris", " blue sky"]
    assert not chat(bad_words=[]).body.sampling.bad_words                   # vLLM's default
    for words, param in ((["x"] * (MAX_BAD_WORDS + 1), "bad_words"), ("Paris", "bad_words"), ([""], "bad_words[0]"),
                         (["ok", 3], "bad_words[1]")):
        assert refused(chat, bad_words=words).field == param
    for s, param in ((common_pb2.SamplingParams(bad_words=["   "]), "sampling.bad_words[0]"),
                     (common_pb2.SamplingParams(bad_words=["x" * (MAX_BAD_WORD_CHARS + 1)]), "sampling.bad_words[0]"),
                     (common_pb2.SamplingParams(bad_words=["x"], regex="a+"), "sampling.bad_words"),
                     (common_pb2.SamplingParams(bad_words=["x"], allowed_token_ids=[1]), "sampling.bad_words")):
        assert refused(check_sampling, s, 2048).field == param
    assert http_param("sampling.bad_words[0]", chat()) == "bad_words[0]"


def test_bad_words_are_tokenized_alone_and_after_a_space_as_vllm_does(text_tokenizer):
    ids = forbidden(common_pb2.SamplingParams(bad_words=["hello", "  hello"]), text_tokenizer)
    alone, spaced = tuple(text_tokenizer.encode("hello")), tuple(text_tokenizer.encode(" hello"))
    assert alone != spaced and ids == (alone, spaced, alone, spaced)     # leading spaces are the word's own
    sampling = SamplingParams(bad_words_ids=ids)
    assert sampling_from_engine(engine_sampling(sampling)).bad_words_ids == ids     # to the worker and back
    # The scheduler's own RPCs are checked as the router's are.
    assert refused(forbidden, common_pb2.SamplingParams(bad_words=["ok", ""]), text_tokenizer).field \
        == "sampling.bad_words[1]"


def id_chunk(text: str, ids, prompt=(), finish: int = 0) -> common_pb2.GenerateChunk:
    chunk = common_pb2.GenerateChunk(text=text, token_ids=list(ids), prompt_token_ids=list(prompt), finish_reason=finish)
    chunk.usage.prompt_tokens, chunk.usage.completion_tokens = 3, 3
    return chunk


def test_token_ids_are_shown_as_vllm_shows_them():
    stop = common_pb2.FINISH_REASON_STOP
    request = chat(return_token_ids=True)
    assert request.token_ids and request.body.sampling.return_token_ids
    whole = OpenAIResponse(request, "r", 7, HIGH)
    for c in (id_chunk("He", [5], [1, 2, 3]), id_chunk("llo", [6, 2], [1, 2, 3], stop)):   # a taken-over pool's again
        whole.add(0, c)
    body = whole.body()
    assert body["prompt_token_ids"] == [1, 2, 3] and body["choices"][0]["token_ids"] == [5, 6, 2]
    stream = OpenAIResponse(chat(return_token_ids=True, stream=True), "r", 7, HIGH)
    events = [e for c in (id_chunk("", [5], [1, 2, 3]), id_chunk("llo", [6, 2], [], stop)) for e in stream.events(0, c)]
    assert events[0]["prompt_token_ids"] == [1, 2, 3] and all("prompt_token_ids" not in e for e in events[1:])
    assert [i for e in events for i in e["choices"][0]["token_ids"]] == [5, 6, 2]   # a held-back token's too
    completion = OpenAIResponse(parse_openai(COMPLETION, json.dumps({"model": "m", "prompt": "x",
                                                                    "return_token_ids": True}).encode()), "r", 7, HIGH)
    completion.add(0, id_chunk("Hi", [5, 2], [9, 8], stop))
    assert completion.body()["choices"][0]["prompt_token_ids"] == [9, 8]
    plain = OpenAIResponse(chat(), "r", 7, HIGH)
    plain.add(0, id_chunk("Hi", [5, 2], [], stop))
    assert "prompt_token_ids" not in plain.body() and "token_ids" not in plain.body()["choices"][0]
    assert refused(chat, return_token_ids="yes").field == "return_token_ids"
