"""Completions' `echo` with `logprobs` (what lm-evaluation-harness sends to score a continuation)
through the official `openai` client on a real cluster (embedded model, fp32): the answer's text
starts with the prompt, its logprobs cover every prompt token (the first null) with the model's
own log-probability given the tokens before it, equal to the engine's logits for the prompt
computed alone, in one step or in chunks, cached or not, streamed or not; a prompt of token ids
is echoed as its text; over gRPC, sampling.prompt_logprobs brings them on the first chunk."""
from __future__ import annotations

import functools
import math

import openai
import pytest

from services.common.proto.qos.v1 import router_pb2
from services.common.step import SequenceWork, StepBatch
from services.common.tokenizer import TextTokenizer
from services.engine.default_model import default_model_dir
from services.local.cluster import LocalCluster
from services.tools.client import RouterClient, sampling_params
from tests.e2e.conftest import cluster_config, run
from tests.tiny_models import make_engine

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Italy is"
# Longer than a step's 64 tokens in this cluster: its prompt is computed over several steps.
LONG = "A lighthouse keeper kept a log of ships, storms and the colour of the sea every morning. " * 6


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(cluster_config(dtype="fp32", max_step_tokens=64), quiet=True) as running:
        yield running


@functools.cache
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_model_dir(default_model_dir(progress=False))


@functools.cache
def engine_logprobs(text: str) -> tuple[list[int], list[float]]:
    """The prompt's token ids, and each token's logprob given the ones before it, from the fp32
    engine's logits for the whole prompt in one step."""
    ids = tokenizer().encode(text)
    engine = make_engine(default_model_dir(progress=False), num_blocks=64, dtype="float32")
    logits = engine.compute_logits(StepBatch([SequenceWork(0, ids, 0, list(range(len(ids) // 16 + 1)))]))[0]
    logprobs = logits.float().log_softmax(-1)
    return ids, [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def scored(client, model, prompt, **extra):
    return client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                     logprobs=2, **extra)


@pytest.mark.parametrize("text", [PROMPT, LONG])
def test_the_echoed_prompts_logprobs_are_the_models_whatever_the_steps(client, model, text):
    ids, expected = engine_logprobs(text)
    answer = scored(client, model, text)
    choice, lp = answer.choices[0], answer.choices[0].logprobs
    assert choice.text.startswith(text) and "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(ids) + 1 == answer.usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=2e-3)
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # lm-evaluation-harness's reading: the continuation's logprob is the sum over its tokens.
    assert math.isfinite(sum(lp.token_logprobs[1:]))


def test_a_cached_prompt_is_computed_again_for_its_logprobs(client, model):
    first = scored(client, model, LONG + " Then")
    plain = client.completions.create(model=model, prompt=LONG + " Then", max_tokens=1)
    again = scored(client, model, LONG + " Then")
    assert plain.usage.prompt_tokens_details.cached_tokens > 0      # the prompt is in the cache ...
    assert again.usage.prompt_tokens_details.cached_tokens == 0     # ... and computed whole for logprobs
    assert again.choices[0].logprobs.token_logprobs == first.choices[0].logprobs.token_logprobs


def test_a_streamed_echo_sends_the_prompt_first_with_the_same_logprobs(client, model):
    whole = scored(client, model, PROMPT, extra_body={"ignore_eos": True}, n=1)
    events = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    texts = [e.choices[0].text for e in events if e.choices]
    assert texts[0].startswith(PROMPT) and "".join(texts) == whole.choices[0].text
    streamed = [v for e in events if e.choices and e.choices[0].logprobs for v in e.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs


def test_a_prompt_of_token_ids_is_echoed_as_its_text_in_each_choice(client, model):
    ids = tokenizer().encode(PROMPT)
    answer = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0.8, seed=1, n=2,
                                       echo=True)
    for choice in answer.choices:
        assert choice.text.startswith(PROMPT) and choice.logprobs is None
    assert answer.usage.prompt_tokens == len(ids)


def test_vllm_prompt_logprobs_without_echo_on_completions_and_chat(client, model):
    """vLLM's prompt_logprobs: the same values as echo's, each with its rank, and the N likeliest;
    on a chat, the response's, of the rendered conversation's tokens."""
    ids, expected = engine_logprobs(PROMPT)
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    positions = answer.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None and not answer.choices[0].text.startswith(PROMPT)
    own = [position[str(token)] for position, token in zip(positions[1:], ids[1:])]
    assert [e["logprob"] for e in own] == pytest.approx(expected, abs=2e-3)
    assert "".join(e["decoded_token"] for e in own) == tokenizer().decode(ids[1:])
    for position, entry in zip(positions[1:], own):
        likeliest = sorted(position.values(), key=lambda e: -e["logprob"])
        assert len(position) in (2, 3) and entry["rank"] >= 1
        assert [e["rank"] for e in likeliest[:2]] == [1, 2] or entry["rank"] > 2
        assert (entry["rank"] == 1) == (entry["logprob"] >= likeliest[0]["logprob"])
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0})
    rendered = chat.model_extra["prompt_logprobs"]
    assert rendered[0] is None and len(rendered) == chat.usage.prompt_tokens
    assert all(len(p) == 1 and next(iter(p.values()))["rank"] >= 1 for p in rendered[1:])
    with pytest.raises(openai.BadRequestError) as streamed:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert streamed.value.param == "prompt_logprobs"


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_scores_the_prompt_alone(client, model, stream):
    """OpenAI's legacy scoring call (echo, logprobs, max_tokens 0): the prompt and its logprobs,
    nothing after it, no completion token counted, finish_reason "length"."""
    ids, expected = engine_logprobs(PROMPT)
    asked = dict(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    if stream:
        chunks = list(client.completions.create(**asked, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
        finish, usage = [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1].usage
    else:
        answer = client.completions.create(**asked)
        text, tokens = answer.choices[0].text, answer.choices[0].logprobs.token_logprobs
        finish, usage = answer.choices[0].finish_reason, answer.usage
    assert text == PROMPT and finish == "length"
    assert len(tokens) == len(ids) and tokens[0] is None and tokens[1:] == pytest.approx(expected, abs=2e-3)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 0)


def test_echo_is_refused_on_a_chat(client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"echo": True})
    assert refused.value.body["param"] == "echo"


def test_grpc_prompt_logprobs_come_on_the_first_chunk(cluster):
    ids, expected = engine_logprobs(PROMPT)

    async def go():
        async with RouterClient(cluster.router_address) as c:
            sampling = sampling_params(max_tokens=3, temperature=0.0, ignore_eos=True)
            sampling.prompt_logprobs = 1
            call = c.stub.Generate(router_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling))
            return [chunk async for chunk in call]

    chunks = run(go())
    first = list(chunks[0].prompt_logprobs)
    assert [e.token_id for e in first] == ids and math.isnan(first[0].logprob)
    assert [e.logprob for e in first[1:]] == pytest.approx(expected, abs=2e-3)
    assert all(len(e.top) == 1 for e in first[1:]) and not any(c.prompt_logprobs for c in chunks[1:])
    assert first[0].rank == 0 and all((e.rank == 1) == (e.top[0].token_id == e.token_id) for e in first[1:])


def test_lm_evaluation_harness_scores_a_batch_of_continuations(client, model):
    """lm-evaluation-harness's local-completions loglikelihood request (its payload: token-id
    prompts in a batch, temperature 0, max_tokens 1, logprobs 1, seed, echo) read as its
    parse_logprobs reads it: the continuation's logprob is the sum of token_logprobs[ctxlen:-1],
    greedy when each of those tokens is its top one."""
    context = tokenizer().encode("The capital of France is")
    continuations = [tokenizer().encode(" Paris"), tokenizer().encode(" a small village in the Alps")]
    answer = client.completions.create(model=model, prompt=[context + c for c in continuations], temperature=0,
                                       max_tokens=1, logprobs=1, seed=1234, echo=True)
    scores = []
    for choice, continuation in zip(sorted(answer.choices, key=lambda c: c.index), continuations):
        logprobs = choice.logprobs.token_logprobs[len(context):-1]
        tops = choice.logprobs.top_logprobs[len(context):-1]
        assert len(logprobs) == len(continuation)
        greedy = all(lp == max(top.values()) for lp, top in zip(logprobs, tops))
        scores.append((sum(logprobs), greedy))
        _, expected = engine_logprobs(tokenizer().decode(context + continuation))
        assert sum(logprobs) == pytest.approx(sum(expected[len(context) - 1:]), abs=1e-2)
    assert scores[0][0] > scores[1][0]          # the model finds Paris likelier than the village
