"""`n` choices and completions' batches of prompts (text or token ids) through the official
`openai` client on a real cluster (embedded model, fp32, where seeded sampling gives the same
tokens whatever shares the batch): each seeded choice is the answer its own seed (seed + index)
gives alone, streamed choices arrive tagged with their index, each with its role, text and
finish_reason, the usage counts each prompt once and every choice's completion, the choices
share the prompt's KV instead of computing it n times, a prompt of token ids is answered as its
text is (over gRPC too), and bad values name the element at fault."""
from __future__ import annotations

import functools

import grpc
import openai
import pytest

from services.common.proto.qos.v1 import router_pb2
from services.common.tokenizer import TextTokenizer
from services.engine.default_model import default_model_dir
from services.tools.client import RouterClient, sampling_params
from tests.e2e.conftest import run

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a village by the sea,"
MESSAGES = [{"role": "user", "content": "Name a colour and say why you like it."}]


@pytest.fixture(scope="module")
def cluster(fp32_cluster):
    return fp32_cluster         # exact tokens: fp32 (the session's shared cluster, tests/e2e/conftest.py)


def test_each_seeded_choice_is_its_own_seeds_answer_alone(client, model):
    both = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    answer = client.completions.create(n=3, seed=41, **both)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    alone = [client.completions.create(seed=41 + i, **both) for i in range(3)]
    assert [c.text for c in answer.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in answer.choices}) > 1          # the seeds differ, so do the answers
    assert answer.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert answer.usage.completion_tokens == 30 and answer.usage.total_tokens == answer.usage.prompt_tokens + 30


def test_a_stream_of_choices_tags_each_with_its_index_and_counts_usage_once(client, model):
    both = dict(model=model, messages=MESSAGES, max_tokens=8, temperature=0.8, seed=7)
    whole = client.chat.completions.create(n=2, **both)
    stream = client.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **both)
    events = list(stream)
    texts, roles, finishes = {0: "", 1: ""}, {}, {}
    for event in events[:-1]:
        assert event.usage is None and len(event.choices) == 1
        choice = event.choices[0]
        assert choice.index not in finishes, "a choice's event after its finish_reason"
        if choice.delta.role:
            assert choice.index not in roles and texts[choice.index] == ""     # its first event
            roles[choice.index] = choice.delta.role
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant"} and set(finishes) == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert [finishes[0], finishes[1]] == [c.finish_reason for c in whole.choices]
    last = events[-1]
    assert last.choices == []           # the usage comes once, after every choice's end
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)


def test_the_choices_compute_the_prompt_once(cluster, client, model):
    """Choice 0 computes the prompt; the others wait for the blocks it is computing and take them
    from the prefix cache (only the partial last block is computed again), as the pool's cache
    counters show; the usage counts the prompt once, choice 0's, which found nothing cached."""
    prompt = "A long shared preamble about the history of lighthouses and their keepers. " * 8

    def hits() -> int:
        return sum(c.cache_hit_tokens for c in run(cluster.pool_stats()).classes)

    before = hits()
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=2, n=4, temperature=1.0)
    shared = hits() - before
    prompt_tokens = answer.usage.prompt_tokens
    assert len(answer.choices) == 4 and answer.usage.completion_tokens == 8
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    assert shared >= 3 * (prompt_tokens - 16), (shared, prompt_tokens)


@pytest.mark.parametrize("n", [0, 17, "2", 2.0, True])
def test_an_n_out_of_range_or_not_an_integer_is_a_400_naming_n(client, model, n):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"n": n})
    assert refused.value.body["param"] == "n"


@functools.cache
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_model_dir(default_model_dir(progress=False))


def test_a_prompt_of_token_ids_is_answered_as_its_text_is(cluster, client, model):
    ids = tokenizer().encode(PROMPT)
    both = dict(model=model, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    as_text = client.completions.create(prompt=PROMPT, **both)
    as_ids = client.completions.create(prompt=ids, **both)
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage.prompt_tokens == len(ids) == as_text.usage.prompt_tokens

    async def grpc_tokens(**prompt):
        async with RouterClient(cluster.router_address) as c:
            request = router_pb2.GenerateRequest(sampling=sampling_params(max_tokens=8, temperature=0.0,
                                                                          ignore_eos=True), **prompt)
            return (await c.generate(request)).token_ids

    assert run(grpc_tokens(prompt_token_ids=ids)) == run(grpc_tokens(prompt=PROMPT))
    with pytest.raises(grpc.aio.AioRpcError) as both_kinds:
        run(grpc_tokens(prompt=PROMPT, prompt_token_ids=ids))
    assert both_kinds.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as past_vocab:
        run(grpc_tokens(prompt_token_ids=[ids[0], 10**6]))
    assert past_vocab.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids[1]=1000000 is not a token id" in past_vocab.value.details()


def test_a_batch_of_prompts_answers_each_with_its_n_choices_in_order(client, model):
    prompts = [PROMPT, "The three primary colours are", "Water boils at"]
    both = dict(model=model, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    batch = client.completions.create(prompt=prompts, n=2, seed=5, **both)
    assert [c.index for c in batch.choices] == list(range(6))
    alone = [client.completions.create(prompt=p, seed=5 + i, **both) for p in prompts for i in range(2)]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone[::2])
    assert batch.usage.completion_tokens == 36
    greedy = dict(both, temperature=0)
    as_ids = client.completions.create(prompt=[tokenizer().encode(p) for p in prompts], **greedy)
    assert [c.text for c in as_ids.choices] == [client.completions.create(prompt=p, **greedy).choices[0].text
                                                for p in prompts]


@pytest.mark.parametrize("prompt, param", [
    ([1, 10**6], "prompt[1]"),                  # past the vocabulary: the scheduler's check
    ([[1, 2], [3, 10**6]], "prompt[1][1]"),     # ... in the second prompt of a batch
    (["a", 7], "prompt[1]"), ([[1], []], "prompt[1]"), ([1, -1], "prompt[1]"),
])
def test_a_bad_prompt_element_is_a_400_naming_it(client, model, prompt, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=prompt, max_tokens=2)
    assert refused.value.body["param"] == param, refused.value.body
    assert "prompt_token_ids" not in refused.value.body["message"]
