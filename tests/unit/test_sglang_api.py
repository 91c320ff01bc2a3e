"""SGLang's native /generate (services/router/openai_api/sglang.py): a body read as the completion
it means, refused by name where it asks for what is not served, and our chunks told as SGLang's
objects (one, a list, a cumulative stream), logprobs as its [logprob, id, text] triples."""
from __future__ import annotations

import json
import math

import pytest

from services.common.errors import ServiceError
from services.common.proto.qos.v1 import common_pb2
from services.router.openai_api.generation import http_param
from services.router.openai_api.sglang import SglangAnswer, is_sglang, parse_sglang


def sglang(**body):
    return parse_sglang({"text": "The sky is", **body}, "m")


def test_a_body_becomes_its_completion():
    assert is_sglang({"text": "x"}) and is_sglang({"input_ids": [1]}) and not is_sglang({"inputs": "x"})
    plain = sglang()
    s = plain.body.sampling
    assert s.max_tokens == 128 and not s.HasField("top_k") and s.return_token_ids and not s.HasField("logprobs")
    tuned = sglang(sampling_params={"max_new_tokens": 5, "temperature": 0, "top_k": 4, "stop": ["."], "no_stop_trim": True,
                                    "min_new_tokens": 2, "regex": "[a-z]+"}, return_logprob=True, top_logprobs_num=2,
                   logprob_start_len=0)
    s = tuned.body.sampling
    assert (s.max_tokens, s.temperature, s.top_k, list(s.stop), s.min_tokens, s.regex) == (5, 0, 4, ["."], 2, "[a-z]+")
    assert s.include_stop_str_in_output and s.logprobs == 2 and s.prompt_logprobs == 2
    ids = parse_sglang({"input_ids": [[1, 2], [3]], "sampling_params": {"n": 2}}, "m")
    assert ids.choices == 4 and not ids.sglang.single
    assert json.loads(sglang(sampling_params={"json_schema": '{"type": "object"}'}).body.sampling.json_schema) \
        == {"type": "object"}
    assert sglang(lora_path="sql").body.model == "sql" and sglang(stream=True).stream


@pytest.mark.parametrize("body, param", [
    ({"sampling_params": {"beams": 2}}, "sampling_params.beams"), ({"image_data": "x.png"}, "image_data"),
    ({"return_hidden_states": True}, "return_hidden_states"), ({"input_ids": [1]}, "text"),
    ({"sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"top_logprobs_num": 30, "return_logprob": True}, "top_logprobs_num"),
    ({"logprob_start_len": 0}, "logprob_start_len"), ({"logprob_start_len": 3, "return_logprob": True}, "logprob_start_len"),
    ({"stream": "yes"}, "stream"), ({"sampling_params": []}, "sampling_params"),
])
def test_what_is_not_served_or_wrong_is_named(body, param):
    with pytest.raises(ServiceError) as refused:
        sglang(**body)
    assert refused.value.field == param


def test_the_schedulers_names_are_the_bodys():
    request = sglang()
    assert http_param("sampling.max_tokens", request) == "sampling_params.max_new_tokens"
    assert http_param("sampling.stop[1]", request) == "sampling_params.stop[1]"
    assert http_param("top_k", request) == "sampling_params.top_k"        # (the HTTP fuzz found it named bare)
    assert http_param("structured_outputs.regex", request) == "sampling_params.regex"


def entry(token_id: int, text: str, logprob: float, top=()) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=token_id, logprob=logprob, token_bytes=text.encode(), top=list(top))


def chunk(text, ids, entries=(), finish=0, completion=0, prompt_ids=(), prompt_entries=()):
    c = common_pb2.GenerateChunk(text=text, token_ids=ids, logprobs=list(entries), finish_reason=finish,
                                 prompt_token_ids=list(prompt_ids), prompt_logprobs=list(prompt_entries))
    c.usage.prompt_tokens, c.usage.completion_tokens = 3, completion
    return c


def test_the_answer_as_sglang_tells_it():
    request = sglang(return_logprob=True, logprob_start_len=0, return_text_in_logprobs=True, rid="mine")
    answer = SglangAnswer(request, "r", 7, 2)
    answer.add(0, chunk(" blue", [5], [entry(5, " blue", -0.1)], prompt_ids=[1, 2, 3],
                        prompt_entries=[entry(1, "The", math.nan), entry(2, " sky", -2.0), entry(3, " is", -1.0)]))
    answer.add(0, chunk(".", [2], [entry(2, "", -0.3)], common_pb2.FINISH_REASON_STOP, 2))
    body = answer.body()
    assert body["text"] == " blue." and body["output_ids"] == [5, 2]
    meta = body["meta_info"]
    assert meta["id"] == "mine" and meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert [(i, t) for _, i, t in meta["output_token_logprobs"]] == [(5, " blue"), (2, "")]
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx([-0.1, -0.3])
    assert meta["input_token_logprobs"] == [[None, 1, "The"], [-2.0, 2, " sky"], [-1.0, 3, " is"]]
    batch = SglangAnswer(parse_sglang({"text": ["a", "b"]}, "m"), "r", 7, 2)
    for k in (0, 1):
        batch.add(k, chunk("x", [9], finish=common_pb2.FINISH_REASON_LENGTH, completion=1))
    assert [b["meta_info"]["id"] for b in batch.body()] == ["r", "r-1"]
    assert batch.body()[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    stopped = SglangAnswer(sglang(sampling_params={"stop": ["."]}), "r", 7, 2)
    last = chunk(" blue", [5, 6], finish=common_pb2.FINISH_REASON_STOP, completion=2)
    last.stop_string = "."            # SGLang's matched: the stop string, not its last token
    stopped.add(0, last)
    assert stopped.body()["meta_info"]["finish_reason"] == {"type": "stop", "matched": "."}


def test_a_stream_is_the_text_so_far_each_time():
    answer = SglangAnswer(sglang(stream=True), "r", 7, 2)
    first = json.loads(answer.frames(0, chunk("A", [4])).removeprefix(b"data: "))
    last = json.loads(answer.frames(0, chunk("B", [5], finish=common_pb2.FINISH_REASON_LENGTH, completion=2))
                      .removeprefix(b"data: "))
    assert (first["text"], first["meta_info"]["finish_reason"]) == ("A", None)
    assert (last["text"], last["output_ids"], answer.end()) == ("AB", [4, 5], b"data: [DONE]\n\n")
