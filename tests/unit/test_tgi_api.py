"""Hugging Face TGI's own API (services/router/openai_api/tgi.py): a body read as the completion
it means, refused by name where it asks for what is not served, errors in TGI's shape and
statuses, and our chunks told as TGI's answer or its token stream."""
from __future__ import annotations

import json
import math

import pytest

from services.common.errors import ErrorKind, ServiceError
from services.common.proto.qos.v1 import common_pb2
from services.router.openai_api.generation import error_response, http_param
from services.router.openai_api.tgi import TgiAnswer, parse_tgi, tgi_error


def tgi(stream=None, **parameters):
    return parse_tgi({"inputs": "The sky is", "parameters": parameters}, "m", stream)


def refused(**parameters) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        tgi(**parameters)
    return caught.value


def test_a_body_becomes_its_completion():
    greedy = tgi(max_new_tokens=7, stop=["."], truncate=5, seed=3)
    s = greedy.body.sampling
    assert greedy.body.prompt == "The sky is" and s.max_tokens == 7 and s.temperature == 0      # do_sample off
    assert list(s.stop) == ["."] and s.include_stop_str_in_output and s.truncate_prompt_tokens == 5 and s.seed == 3
    assert not s.HasField("logprobs") and not greedy.stream
    sampled = tgi(do_sample=True, top_k=5, details=True, top_n_tokens=2)
    assert sampled.body.sampling.top_k == 5 and not sampled.body.sampling.HasField("temperature")
    assert sampled.body.sampling.logprobs == 2
    assert tgi(temperature=0.7).body.sampling.temperature == pytest.approx(0.7)     # a temperature samples
    assert tgi(stream=True).stream and tgi(stream=True).body.sampling.HasField("logprobs")   # each token's id
    assert parse_tgi({"inputs": "x", "stream": True}, "m", None).stream      # the compat route: the body says
    assert tgi(grammar={"type": "regex", "value": "[a-z]+"}).body.sampling.regex == "[a-z]+"
    assert json.loads(tgi(grammar={"type": "json", "value": {"type": "object"}}).body.sampling.json_schema) \
        == {"type": "object"}
    assert tgi(adapter_id="sql").body.model == "sql"


@pytest.mark.parametrize("parameters, param", [
    ({"best_of": 2}, "parameters.best_of"), ({"typical_p": 0}, "parameters.typical_p"),
    ({"typical_p": 1.5}, "parameters.typical_p"), ({"typical_p": True}, "parameters.typical_p"),
    ({"watermark": True}, "parameters.watermark"), ({"decoder_input_details": 1}, "parameters.decoder_input_details"),
    ({"beams": 2}, "parameters.beams"), ({"grammar": {"type": "lark"}}, "parameters.grammar"),
    ({"max_new_tokens": 0}, "parameters.max_new_tokens"), ({"temperature": -1}, "parameters.temperature"),
    ({"stop": [""]}, "parameters.stop[0]"), ({"top_n_tokens": 50}, "parameters.top_n_tokens"),
    ({"details": "yes"}, "parameters.details"), ({"do_sample": 1}, "parameters.do_sample"),
    ({"grammar": {"type": "regex", "value": "("}}, "parameters.grammar"),
])
def test_what_is_not_served_or_wrong_is_named(parameters, param):
    assert refused(**parameters).field == param


def test_typical_p_samples_as_tgi_does():
    """LangChain's HuggingFaceEndpoint sends typical_p 0.95 by default: it is served, and as in
    TGI a warper given samples even without do_sample."""
    sampling = tgi(typical_p=0.95).body.sampling
    assert sampling.typical_p == pytest.approx(0.95) and not sampling.HasField("temperature")
    assert not tgi().body.sampling.HasField("typical_p") and tgi().body.sampling.temperature == 0


def test_decoder_input_details_lists_the_inputs_tokens_and_logprobs():
    assert tgi(details=True, decoder_input_details=True).body.sampling.prompt_logprobs == 0
    assert not tgi(decoder_input_details=True).body.sampling.HasField("prompt_logprobs")   # no details: none
    with pytest.raises(ServiceError, match="not served on a stream") as caught:
        tgi(stream=True, details=True, decoder_input_details=True)
    assert caught.value.field == "parameters.decoder_input_details"
    answer = TgiAnswer(tgi(details=True, decoder_input_details=True), "r", 7, 2)
    first = chunk(" blue", [entry(5, " blue", -0.1)], 0, 0)
    first.prompt_logprobs.extend([entry(1, "The", math.nan), entry(2, " sky", -2.0), entry(3, " is", -1.0)])
    answer.add(0, first)
    answer.add(0, chunk(".", [entry(6, ".", -0.2)], common_pb2.FINISH_REASON_LENGTH, 2))
    assert answer.body()["details"]["prefill"] == [{"id": 1, "text": "The", "logprob": None},
                                                   {"id": 2, "text": " sky", "logprob": -2.0},
                                                   {"id": 3, "text": " is", "logprob": -1.0}]


def test_errors_are_tgis_shape_and_status():
    request = tgi()
    status, body = tgi_error(ServiceError(ErrorKind.INVALID, "sampling.max_tokens=9 does not fit",
                                          field="sampling.max_tokens"), http_param("sampling.max_tokens", request))
    assert status == 422 and body == {"error": "parameters.max_new_tokens=9 does not fit", "error_type": "validation"}
    busy = error_response(ServiceError(ErrorKind.EXHAUSTED, "queue full", retry_after_ms=1500, reason="queue_full"),
                          request)
    assert busy.status_code == 429 and json.loads(busy.body)["error_type"] == "overloaded"
    assert busy.headers["retry-after"] == "2"
    assert tgi_error(ServiceError(ErrorKind.UNAVAILABLE, "no worker"), None)[1]["error_type"] == "generation"
    with pytest.raises(ServiceError) as missing:
        parse_tgi({"parameters": {}}, "m", False)
    assert missing.value.field == "inputs"


def entry(token_id: int, text: str, logprob: float) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=token_id, logprob=logprob, token_bytes=text.encode())


def chunk(text: str, entries, finish: int = 0, completion: int = 0) -> common_pb2.GenerateChunk:
    c = common_pb2.GenerateChunk(text=text, token_ids=[e.token_id for e in entries], logprobs=entries,
                                 finish_reason=finish)
    c.usage.prompt_tokens, c.usage.completion_tokens = 3, completion
    return c


STORY = [chunk(" blue", [entry(5, " blue", -0.1)]),
         chunk(".<|im_end|>", [entry(6, ".", -0.2), entry(2, "<|im_end|>", -0.3)], common_pb2.FINISH_REASON_STOP, 3)]


def test_the_answer_and_its_details():
    answer = TgiAnswer(tgi(details=True, return_full_text=True, seed=4), "r", 7, 2)
    for c in STORY:
        answer.add(0, c)
    body = answer.body()
    assert body["generated_text"] == "The sky is blue.<|im_end|>"
    details = body["details"]
    assert (details["finish_reason"], details["generated_tokens"], details["seed"]) == ("eos_token", 3, 4)
    assert [(t["id"], t["text"], t["special"]) for t in details["tokens"]] == [
        (5, " blue", False), (6, ".", False), (2, "<|im_end|>", True)]
    stopped = TgiAnswer(tgi(stop=["."], details=True), "r", 7, 2)
    last = chunk(" blue.", [entry(5, " blue", -0.1), entry(6, ".", -0.2)], common_pb2.FINISH_REASON_STOP, 2)
    last.stop_string = "."               # the scheduler says which stop string ended it
    stopped.add(0, last)
    assert stopped.body()["details"]["finish_reason"] == "stop_sequence"
    plain = TgiAnswer(tgi(), "r", 7, 2)
    plain.add(0, chunk(" blue", [], common_pb2.FINISH_REASON_LENGTH, 1))
    assert plain.body() == {"generated_text": " blue"}


def test_a_stream_is_a_token_event_each_the_last_with_the_whole_text():
    answer = TgiAnswer(tgi(stream=True, details=True), "r", 7, 2)
    events = [json.loads(line.removeprefix(b"data:")) for c in STORY for line in answer.frames(0, c).split(b"\n\n")
              if line]
    assert [e["index"] for e in events] == [1, 2, 3] and [e["token"]["id"] for e in events] == [5, 6, 2]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:2])
    assert events[2]["generated_text"] == " blue.<|im_end|>" and events[2]["token"]["special"]
    assert events[2]["details"] == {"finish_reason": "eos_token", "generated_tokens": 3, "seed": None,
                                    "input_length": 3}
    assert answer.finished
    quiet = TgiAnswer(tgi(stream=True), "r", 7, 2)
    assert json.loads(quiet.frames(0, STORY[1]).split(b"\n\n")[-2].removeprefix(b"data:"))["details"] is None
    failed = TgiAnswer.failed(ServiceError(ErrorKind.UNAVAILABLE, "worker lost"), None)
    assert json.loads(failed.removeprefix(b"data:")) == {"error": "worker lost", "error_type": "generation"}
