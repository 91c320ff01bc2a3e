"""Logprobs on both HTTP endpoints (streamed and not) and over gRPC, with the official `openai`
client, against a real cluster serving the embedded model in fp32: every value within 1e-4 of
the engine's log-softmax recomputed here over the same tokens, in fp32."""
from __future__ import annotations

import functools

import openai
import pytest
import torch

from services.common.tokenizer import TextTokenizer
from services.engine.default_model import default_model_dir
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import run

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def cluster(fp32_cluster):
    return fp32_cluster         # exact tokens: fp32 (the session's shared cluster, tests/e2e/conftest.py)


@functools.cache
def recompute():
    """The engine, in fp32, and the tokenizer: log-softmax of the logits at every position."""
    from tests.tiny_models import make_engine
    engine = make_engine(default_model_dir(progress=False), num_blocks=64, dtype="float32")
    return engine, TextTokenizer.from_model_dir(default_model_dir(progress=False))


def reference(prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output_ids), vocab]: the log-probabilities each output token was drawn from."""
    from services.common.step import SequenceWork, StepBatch
    engine, _ = recompute()
    tokens = prompt_ids + output_ids
    logits = engine.compute_logits(StepBatch([SequenceWork(1, tokens, 0, list(range(64)))]))[1]
    return logits[len(prompt_ids) - 1:len(tokens) - 1].double().log_softmax(dim=-1)


def worst_error(prompt_ids, output_ids, logprobs, tops) -> float:
    """The largest difference of `logprobs` (one per output token) and `tops` ([(id, logprob)]
    per token) from the recomputation."""
    rows = reference(prompt_ids, output_ids)
    worst = max(abs(lp - rows[i, t].item()) for i, (t, lp) in enumerate(zip(output_ids, logprobs)))
    for i, top in enumerate(tops):
        expected = rows[i].topk(len(top))
        for (token_id, value), best in zip(top, expected.values.tolist()):
            worst = max(worst, abs(value - best), abs(value - rows[i, token_id].item()))
    return worst


@functools.cache
def id_of_bytes() -> dict[bytes, int]:
    """Each token's id by its bytes (byte-level BPE: no two tokens share them), to read the ids of
    an HTTP answer's tokens from its entries' exact `bytes`."""
    from services.common.token_bytes import byte_table
    _, tok = recompute()
    table = byte_table(tok)
    return {table.decode_bytes([i]): i for i in reversed(range(tok.vocab_size))}


def ids(entries) -> list[int]:
    return [id_of_bytes()[bytes(e.bytes)] for e in entries]


def test_chat_logprobs_match_the_engine_within_1e_4_streamed_or_not(client, model):
    _, tok = recompute()
    answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0,
                                            logprobs=True, top_logprobs=5)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens and all(len(e.top_logprobs) == 5 for e in content)
    output_ids = ids(content)
    assert tok.decode(output_ids) == answer.choices[0].message.content
    assert all(e.token == e.top_logprobs[0].token for e in content)          # greedy: the most likely
    worst = worst_error(tok.encode_chat(MESSAGES), output_ids, [e.logprob for e in content],
                        [list(zip(ids(e.top_logprobs), (t.logprob for t in e.top_logprobs))) for e in content])
    print(f"logprob max error vs the engine (fp32): {worst:.3g}")
    assert worst < TOLERANCE, worst

    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0,
                                            logprobs=True, top_logprobs=5, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < TOLERANCE


def test_grpc_logprobs_carry_token_ids_and_match_the_engine(cluster):
    _, tok = recompute()

    async def go():
        request = chat_request(MESSAGES[0]["content"], sampling_params(max_tokens=20, temperature=0.0, logprobs=3))
        async with RouterClient(cluster.router_address) as c:
            return [chunk async for chunk in c.stream(request)]
    chunks = run(go())
    output_ids = [t for c in chunks for t in c.token_ids]
    entries = [e for c in chunks for e in c.logprobs]
    assert [e.token_id for e in entries] == output_ids
    assert b"".join(e.token_bytes for e in entries).decode() == "".join(c.text for c in chunks)
    worst = worst_error(tok.encode_chat(MESSAGES), output_ids, [e.logprob for e in entries],
                        [[(t.token_id, t.logprob) for t in e.top] for e in entries])
    print(f"logprob max error vs the engine (fp32): {worst:.3g}")
    assert worst < TOLERANCE, worst


def test_completion_logprobs_in_the_legacy_shape_streamed_or_not(client, model):
    _, tok = recompute()
    prompt = "The capital of France is"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    assert "".join(lp.tokens) == whole.choices[0].text and len(lp.tokens) == whole.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(lp.top_logprobs[i][t] == lp.token_logprobs[i] and len(lp.top_logprobs[i]) <= 3
               for i, t in enumerate(lp.tokens))
    output_ids = [id_of_bytes()[t.encode()] for t in lp.tokens]     # whole characters here: exact
    assert worst_error(tok.encode(prompt), output_ids, lp.token_logprobs, []) < TOLERANCE
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                       stream=True)
    parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_logprob_bounds_are_400s_naming_the_field(client, model):
    for extra, param in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": "yes"}, "logprobs")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body=extra)
        assert caught.value.param == param
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt="x", max_tokens=2, logprobs=21)
    assert caught.value.param == "logprobs"
