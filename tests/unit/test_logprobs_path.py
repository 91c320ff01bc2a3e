"""Logprobs from a step's answer to OpenAI's objects: each chunk carries exactly its tokens'
entries (merged chunks too), with each token's exact bytes; chat's and completions' shapes."""
from __future__ import annotations

import json
import math

from services.common.priority import MEDIUM
from services.common.proto.qos.v1 import common_pb2, worker_pb2
from services.common.step import FinishReason, SampledToken, SamplingParams, TokenLogprobs
from services.common.wire import answer_tokens
from services.router.openai_api.request import CHAT, COMPLETION, parse_openai
from services.router.openai_api.response import OpenAIResponse
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.output import merge, token_chunk
from services.scheduler.request import Phase, Request
from services.scheduler.stream_out import StreamOut
from tests.unit.detok_helpers import encode, load_text_tokenizer


def request(seq_id: int, logprobs: int | None) -> Request:
    tok = load_text_tokenizer().tokenizer
    r = Request(request_id=f"r{seq_id}", seq_id=seq_id, priority=MEDIUM, tenant="", prompt_ids=[3, 4],
                sampling=SamplingParams(max_tokens=100, logprobs=logprobs),
                detokenizer=IncrementalDetokenizer(tok, [3, 4]))
    r.phase = Phase.RUNNING
    return r


def test_each_chunk_carries_its_tokens_logprobs_with_their_exact_bytes():
    tok = load_text_tokenizer().tokenizer
    ids = encode(tok, "hé 😀")                     # the emoji's bytes are split over tokens
    asks, silent = request(1, 2), request(2, None)
    chunks = []
    for i, token_id in enumerate(ids):
        top = ((token_id, -0.25), (28, -1.5))
        answer = answer_tokens(worker_pb2.StepResult(step_id=i), [
            SampledToken(1, token_id, None, TokenLogprobs(-0.25 - i, top)), SampledToken(2, token_id)], True)
        sampled, _ = StreamOut.answer_tokens(answer, [asks, silent])
        assert list(sampled) == [(1, token_id), (2, token_id)]
        for r in (asks, silent):
            r.add_output(token_id)
        chunks.append(token_chunk(asks, token_id, None, "cpu", 0.0))
        assert not token_chunk(silent, token_id, None, "cpu", 0.0).logprobs     # it did not ask
    assert [c.logprobs[0].logprob for c in chunks] == [-0.25 - i for i in range(len(ids))]
    assert b"".join(c.logprobs[0].token_bytes for c in chunks) == "hé 😀".encode()
    assert [t.token_bytes for t in chunks[0].logprobs[0].top] == [b"h", b","]
    merged = common_pb2.GenerateChunk()
    for c in chunks:
        merge(merged, c)
    assert [e.token_id for e in merged.logprobs] == list(merged.token_ids) == ids


def test_a_finished_or_cancelled_request_takes_no_logprobs():
    done = request(1, 0)
    done.phase = Phase.FINISHED
    gone = request(2, 0)
    gone.cancelled = True
    answer = answer_tokens(worker_pb2.StepResult(step_id=1), [
        SampledToken(1, 5, FinishReason.STOP, TokenLogprobs(-1.0)), SampledToken(2, 6, None, TokenLogprobs(-2.0))], True)
    StreamOut.answer_tokens(answer, [done, gone])
    assert not done.logprobs and not gone.logprobs


def entry(token: bytes, logprob: float, *top: tuple[bytes, float]) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=1, logprob=logprob, token_bytes=token,
                                   top=[common_pb2.TopLogprob(token_id=2, logprob=lp, token_bytes=b)
                                        for b, lp in top])


def chunk(text: str, entries, finish: int = 0) -> common_pb2.GenerateChunk:
    return common_pb2.GenerateChunk(text=text, token_ids=[1] * len(entries), logprobs=entries,
                                    finish_reason=finish)


def test_chat_logprobs_whole_and_streamed():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1}
    whole = OpenAIResponse(parse_openai(CHAT, json.dumps(body).encode()), "a", 1, MEDIUM)
    whole.add(0, chunk("Hi", [entry(b"Hi", -0.5, (b"Hi", -0.5))]))
    whole.add(0, chunk("", [entry(b"\xf0\x9f", -1.0)], common_pb2.FINISH_REASON_STOP))
    assert whole.body()["choices"][0]["logprobs"] == {"content": [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
         "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}]},
        {"token": "\ufffd", "logprob": -1.0, "bytes": [240, 159], "top_logprobs": []}], "refusal": None}
    streamed = OpenAIResponse(parse_openai(CHAT, json.dumps({**body, "stream": True}).encode()), "a", 1, MEDIUM)
    events = streamed.events(0, chunk("Hi", [entry(b"Hi", -0.5)])) + \
        streamed.events(0, chunk("", [entry(b"!", -0.1)], common_pb2.FINISH_REASON_STOP))
    # role, "Hi", a token whose text is still held (its entry comes anyway), the finish
    assert [e["choices"][0]["logprobs"] and [c["token"] for c in e["choices"][0]["logprobs"]["content"]]
            for e in events] == [None, ["Hi"], ["!"], None]


def test_completion_logprobs_in_the_legacy_shape_with_offsets_across_chunks():
    body = {"model": "m", "prompt": "x", "logprobs": 1, "stream": True}
    out = OpenAIResponse(parse_openai(COMPLETION, json.dumps(body).encode()), "a", 1, MEDIUM)
    events = out.events(0, chunk("Hi there", [entry(b"Hi", -0.5, (b"Yo", -0.25)), entry(b" there", -1.0, (b" there", -1.0))]))
    events += out.events(0, chunk("!", [entry(b"!", -2.0, (b".", -0.5))], common_pb2.FINISH_REASON_STOP))
    first, second = events[0]["choices"][0]["logprobs"], events[1]["choices"][0]["logprobs"]
    assert first == {"tokens": ["Hi", " there"], "token_logprobs": [-0.5, -1.0],
                     "top_logprobs": [{"Yo": -0.25, "Hi": -0.5}, {" there": -1.0}], "text_offset": [0, 2]}
    assert second["text_offset"] == [8] and second["top_logprobs"] == [{".": -0.5, "!": -2.0}]


def test_prompt_logprobs_reach_the_first_chunk_in_order_once_whatever_the_steps():
    """Two prefill chunks' answers, a chunk computed again (a preemption) keeping its first
    entries, then the first token's chunk carrying every prompt token, the first with no logprob."""
    from services.common.step import PromptLogprobs
    from services.common.wire import answer_prompt_logprobs
    tok = load_text_tokenizer().tokenizer
    prompt = encode(tok, "one two three four five")
    r = Request(request_id="p", seq_id=9, priority=MEDIUM, tenant="", prompt_ids=prompt,
                sampling=SamplingParams(max_tokens=5, prompt_logprobs=1), detokenizer=IncrementalDetokenizer(tok, prompt))
    r.phase, r.prompt_logprobs = Phase.RUNNING, {}

    def step(first: int, values: list[float]) -> None:
        answer = worker_pb2.StepResult(step_id=first)
        targets = tuple(prompt[first:first + len(values)])
        answer_prompt_logprobs(answer, [PromptLogprobs(9, first, targets,
                                                       tuple(TokenLogprobs(v, ((targets[0], v),)) for v in values))])
        StreamOut.answer_tokens(answer, [r])

    step(1, [-1.0, -2.0])
    step(1, [-9.0, -9.0])                    # computed again after a preemption: the first stay
    step(3, [-3.0] * (len(prompt) - 3))
    r.add_output(7)
    first = token_chunk(r, 7, None, "cpu", 0.0)
    entries = list(first.prompt_logprobs)
    assert [e.token_id for e in entries] == prompt
    assert math.isnan(entries[0].logprob) and not entries[0].top
    assert [e.logprob for e in entries[1:3]] == [-1.0, -2.0] and entries[3].logprob == -3.0
    assert b"".join(e.token_bytes for e in entries) == "one two three four five".encode()
    r.add_output(8)
    assert not token_chunk(r, 8, None, "cpu", 0.0).prompt_logprobs and r.prompt_logprobs is None


def test_an_echoed_completion_starts_with_its_prompt_and_its_first_token_has_no_logprob():
    out = OpenAIResponse(parse_openai(COMPLETION, b'{"model": "m", "prompt": "Hi", "echo": true, "logprobs": 1}'),
                         "a", 1, MEDIUM)
    chunk = common_pb2.GenerateChunk(text="!", finish_reason=common_pb2.FINISH_REASON_LENGTH)
    chunk.prompt_logprobs.add(token_id=1, logprob=float("nan"), token_bytes=b"H")
    chunk.prompt_logprobs.add(token_id=2, logprob=-0.5, token_bytes=b"i", top=[common_pb2.TopLogprob(
        token_id=3, logprob=-0.25, token_bytes=b"o")])
    chunk.logprobs.add(token_id=4, logprob=-1.0, token_bytes=b"!")
    out.add(0, chunk)
    choice = out.body()["choices"][0]
    assert choice["text"] == "Hi!"
    assert choice["logprobs"] == {"tokens": ["H", "i", "!"], "token_logprobs": [None, -0.5, -1.0],
                                  "top_logprobs": [None, {"o": -0.25, "i": -0.5}, {"!": -1.0}],
                                  "text_offset": [0, 1, 2]}
    json.dumps(out.body(), allow_nan=False)          # no NaN reaches the JSON


def test_the_first_chunk_carries_the_prompts_ids_when_asked():
    asks, silent = request(21, None), request(22, None)
    asks.return_prompt_ids = True
    for r in (asks, silent):
        r.add_output(encode(load_text_tokenizer().tokenizer, "Hi")[0])
    assert list(token_chunk(asks, asks.output_ids[-1], None, "cpu", 0.0).prompt_token_ids) == [3, 4]
    assert not token_chunk(silent, silent.output_ids[-1], None, "cpu", 0.0).prompt_token_ids
    asks.add_output(asks.output_ids[-1])
    assert not token_chunk(asks, asks.output_ids[-1], None, "cpu", 0.0).prompt_token_ids     # the first only
