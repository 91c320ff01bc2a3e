"""vLLM's extra request fields through the official `openai` client (extra_body, as vLLM's docs
send them) on a real cluster (embedded SmolLM2, fp32, greedy unless said): each one changes the
answer as vLLM's does, checked against the same answer reached another way (a prompt of token
ids, a rendered conversation, a request without the option); and over gRPC the chat options."""
from __future__ import annotations

import json

import openai
import pytest

from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.tools.client import RouterClient, sampling_params
from tests.e2e.conftest import run
from tests.e2e.test_http_api import raw

pytestmark = pytest.mark.slow

STORY = [{"role": "user", "content": "Tell me a short story about a cat."},
         {"role": "assistant", "content": "Once upon a time, a cat named"}]
PROMPT = "The three primary colours are red, yellow and"
IM_END = 2          # SmolLM2's <|im_end|>: its EOS, a special token


@pytest.fixture(scope="module")
def cluster(fp32_cluster):
    return fp32_cluster         # exact tokens: fp32 (the session's shared cluster, tests/e2e/conftest.py)


def tokenize(cluster, body: dict) -> list[int]:
    status, _, data = raw(cluster, "POST", "/tokenize", json.dumps(body).encode())
    assert status == 200, data
    return json.loads(data)["tokens"]


def complete(client, model, prompt, **extra):
    return client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)


def test_continue_final_message_continues_the_assistants_answer(client, cluster, model):
    """The prompt ends inside the assistant's message, as /tokenize renders it with the same
    options; the answer is the completion of exactly those tokens."""
    body = {"add_generation_prompt": False, "continue_final_message": True}
    ids = tokenize(cluster, {"model": model, "messages": STORY, **body})
    answer = client.chat.completions.create(model=model, messages=STORY, max_tokens=12, temperature=0, extra_body=body)
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == complete(client, model, ids).choices[0].text
    fresh = client.chat.completions.create(model=model, messages=STORY, max_tokens=12, temperature=0)
    opened = tokenize(cluster, {"model": model, "messages": STORY})     # the message closed, a new turn opened
    assert fresh.usage.prompt_tokens == len(opened) > len(ids) and opened[:len(ids)] == ids
    closed = tokenize(cluster, {"model": model, "messages": STORY, "add_generation_prompt": False})
    assert closed == ids + tokenize(cluster, {"model": model, "prompt": "<|im_end|>\n"})


def test_template_variables_are_taken_and_the_templates_own_names_refused(client, model):
    plain = client.chat.completions.create(model=model, messages=STORY[:1], max_tokens=8, temperature=0)
    with_kwargs = client.chat.completions.create(model=model, messages=STORY[:1], max_tokens=8, temperature=0,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert with_kwargs.choices[0].message.content == plain.choices[0].message.content    # SmolLM2's reads none
    for extra, param in (({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
                         ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=STORY, max_tokens=4, extra_body=extra)
        assert refused.value.body["param"] == param


def test_the_stop_string_is_kept_when_asked(client, model):
    whole = complete(client, model, PROMPT).choices[0].text
    stop = whole.split()[1]                 # a word inside the answer
    cut = complete(client, model, PROMPT, stop=[stop])
    kept = complete(client, model, PROMPT, stop=[stop], include_stop_str_in_output=True)
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    assert kept.choices[0].text == cut.choices[0].text + stop == whole[:whole.index(stop) + len(stop)]


def test_stop_reason_names_what_ended_the_answer(client, cluster, model):
    """vLLM's stop_reason: the stop string that matched (whole and streamed, and SGLang's
    `matched`), a stop token's id, None for the length."""
    whole = complete(client, model, PROMPT).choices[0].text
    stop = whole.split()[1]
    assert complete(client, model, PROMPT, stop=["never in it", stop]).choices[0].stop_reason == stop
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                         extra_body={"stop": [stop]})
    assert [c.choices[0].stop_reason for c in streamed if c.choices[0].finish_reason] == [stop]
    second = complete(client, model, PROMPT, return_token_ids=True).choices[0].token_ids[1]   # the answer's 2nd
    by_token = complete(client, model, PROMPT, stop_token_ids=[second]).choices[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", second)
    assert complete(client, model, PROMPT).choices[0].stop_reason is None       # cut at max_tokens
    status, _, data = raw(cluster, "POST", "/generate", json.dumps(
        {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop": [stop]}}).encode())
    assert status == 200 and json.loads(data)["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_allowed_tokens_alone_are_sampled_and_named_by_id(client, cluster, model):
    allowed = tokenize(cluster, {"model": model, "prompt": " blue green purple, and"})
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, logprobs=2, **sampling,
                                           extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True})
        tokens = answer.choices[0].logprobs.tokens
        assert len(tokens) == answer.usage.completion_tokens > 0
        assert {int(t.removeprefix("token_id:")) for t in tokens} <= set(allowed), tokens
        assert all(k.startswith("token_id:") for top in answer.choices[0].logprobs.top_logprobs for k in top)
    with pytest.raises(openai.BadRequestError) as refused:      # an id past the vocabulary: the scheduler's check
        complete(client, model, PROMPT, allowed_token_ids=[3, 10**6])
    assert refused.value.body["param"] == "allowed_token_ids[1]"
    with pytest.raises(openai.BadRequestError) as refused:
        complete(client, model, PROMPT, allowed_token_ids=[3], structured_outputs={"choice": ["a", "b"]})
    assert refused.value.body["param"] == "allowed_token_ids"


def ids_of(answer) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens]


def test_bad_words_never_end_the_answers_tokens(client, cluster, model):
    """A word of the greedy answer forbidden: the answer changes where it would have come, and
    neither its tokens alone nor after a space appear in the new one, greedy or drawn."""
    ask = {"model": model, "prompt": PROMPT, "max_tokens": 16, "logprobs": 0}
    plain = client.completions.create(**ask, temperature=0, extra_body={"return_tokens_as_token_ids": True})
    word = plain.choices[0].text.split()[0].strip(".,")
    banned = [tokenize(cluster, {"model": model, "prompt": form}) for form in (word, " " + word)]
    assert any(ids_of(plain)[k:k + len(b)] == b for b in banned for k in range(16)), (word, banned)
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        answer = client.completions.create(**ask, **sampling, extra_body={"bad_words": [word],
                                                                          "return_tokens_as_token_ids": True})
        got = ids_of(answer)
        assert not any(got[k:k + len(b)] == b for b in banned for k in range(len(got))), (word, got)
    assert answer.choices[0].text != plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        complete(client, model, PROMPT, bad_words=[word], structured_outputs={"choice": ["a", "b"]})
    assert refused.value.body["param"] == "bad_words"


def detokenize(cluster, model, ids) -> str:
    status, _, data = raw(cluster, "POST", "/detokenize", json.dumps({"model": model, "tokens": ids}).encode())
    assert status == 200, data
    return json.loads(data)["prompt"]


def test_token_ids_are_the_prompts_and_the_answers(client, cluster, model):
    """return_token_ids: the prompt's ids are /tokenize's for the same conversation; the answer's
    decode to its text and the EOS that ended it; streamed, the same ids, the prompt's once."""
    question = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=model, messages=question, max_tokens=40, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert whole.prompt_token_ids == tokenize(cluster, {"model": model, "messages": question})
    ids = whole.choices[0].token_ids
    assert len(ids) == whole.usage.completion_tokens and whole.choices[0].finish_reason == "stop"
    assert detokenize(cluster, model, ids) == whole.choices[0].message.content + "<|im_end|>"
    streamed, prompts = [], []
    for chunk in client.chat.completions.create(model=model, messages=question, max_tokens=40, temperature=0,
                                                stream=True, extra_body={"return_token_ids": True}):
        prompts.append(getattr(chunk, "prompt_token_ids", None))
        streamed += chunk.choices[0].token_ids if chunk.choices else []
    assert prompts[0] == whole.prompt_token_ids and not any(prompts[1:]) and streamed == ids
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert completion.choices[0].prompt_token_ids == tokenize(cluster, {"model": model, "prompt": PROMPT})
    assert detokenize(cluster, model, completion.choices[0].token_ids) == completion.choices[0].text
    assert getattr(client.chat.completions.create(model=model, messages=question, max_tokens=2),
                   "prompt_token_ids", None) is None


def test_special_tokens_are_written_when_not_skipped(client, model):
    """Only the EOS allowed, past EOS: three <|im_end|> tokens, text only when asked for."""
    extra = {"allowed_token_ids": [IM_END], "ignore_eos": True}
    skipped = complete(client, model, PROMPT, max_tokens=3, **extra)
    written = complete(client, model, PROMPT, max_tokens=3, skip_special_tokens=False, **extra)
    assert skipped.usage.completion_tokens == written.usage.completion_tokens == 3
    assert skipped.choices[0].text == "" and written.choices[0].text == "<|im_end|>" * 3


def test_a_prompt_cut_to_its_last_tokens_answers_as_those_tokens(client, cluster, model):
    long = "A lighthouse keeper kept a log of ships and storms. " * 4 + PROMPT
    ids = tokenize(cluster, {"model": model, "prompt": long})
    cut = complete(client, model, long, truncate_prompt_tokens=12)
    assert cut.usage.prompt_tokens == 12
    assert cut.choices[0].text == complete(client, model, ids[-12:]).choices[0].text
    room = complete(client, model, long, truncate_prompt_tokens=-1)           # fits already: nothing cut
    assert room.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as refused:
        complete(client, model, long, truncate_prompt_tokens=10**6)
    assert refused.value.body["param"] == "truncate_prompt_tokens"


def test_grpc_carries_the_chat_options(cluster, client, model):
    """GenerateRequest.chat_template: the same prompt as the HTTP front's, the same answer."""
    http = client.chat.completions.create(model=model, messages=STORY, max_tokens=8, temperature=0,
                                          extra_body={"continue_final_message": True})
    request = router_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(**m) for m in STORY],
                                         sampling=sampling_params(max_tokens=8, temperature=0.0),
                                         chat_template=common_pb2.ChatTemplateOptions(continue_final_message=True))

    async def ask():
        async with RouterClient(cluster.router_address) as c:
            return await c.generate(request, priority="medium")
    answer = run(ask())
    assert answer.text == http.choices[0].message.content and answer.prompt_tokens == http.usage.prompt_tokens
