"""Hugging Face TGI's own API through huggingface_hub's InferenceClient (the client TGI's users
call it with) on the session's fp32 cluster: the greedy text and each token's id and logprob
equal our completions endpoint's for the same prompt; a stream's tokens add up to its text, the
last with the details; a stop sequence kept; a JSON grammar followed; bad parameters are TGI's
validation errors; /info names the model."""
from __future__ import annotations

import json
import urllib.request
import warnings

import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError

pytestmark = pytest.mark.slow

PROMPT = "The three primary colours are red, yellow and"


@pytest.fixture(scope="module")
def cluster(fp32_cluster):
    return fp32_cluster         # exact tokens: fp32 (the session's shared cluster, tests/e2e/conftest.py)


@pytest.fixture(scope="module")
def hf(cluster):
    router = cluster.config.router
    return InferenceClient(base_url=f"http://{router.host}:{router.http_port}", headers={"x-priority": "high"})


def test_the_answer_and_its_tokens_are_the_completion_endpoints(hf, client, model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # the client took us for TGI (no "not served via TGI" warning)
        out = hf.text_generation(PROMPT, max_new_tokens=12, details=True, top_n_tokens=2)
    ours = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                     extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    assert out.generated_text == ours.choices[0].text
    assert [t.id for t in out.details.tokens] == ours.choices[0].token_ids
    assert [t.logprob for t in out.details.tokens] == pytest.approx(ours.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert out.details.generated_tokens == ours.usage.completion_tokens and len(out.details.top_tokens[0]) == 2
    assert out.details.finish_reason == ("length" if ours.choices[0].finish_reason == "length" else "eos_token")
    assert hf.text_generation(PROMPT, max_new_tokens=12, return_full_text=True) == PROMPT + out.generated_text


def test_a_stream_adds_up_to_its_text_and_ends_with_the_details(hf):
    whole = hf.text_generation(PROMPT, max_new_tokens=20, details=True)
    events = list(hf.text_generation(PROMPT, max_new_tokens=20, stream=True, details=True))
    assert [e.index for e in events] == list(range(1, len(events) + 1))
    assert [e.token.id for e in events] == [t.id for t in whole.details.tokens]
    assert events[-1].generated_text == whole.generated_text and events[-1].details.generated_tokens == len(events)
    assert all(e.generated_text is None for e in events[:-1])
    assert "".join(e.token.text for e in events if not e.token.special) == whole.generated_text.removesuffix("<|im_end|>")


def test_a_stop_sequence_stays_and_a_grammar_is_followed(hf):
    stopped = hf.text_generation(PROMPT, max_new_tokens=30, stop=["e"], details=True)
    assert stopped.generated_text.endswith("e") and stopped.details.finish_reason == "stop_sequence"
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}}, "required": ["colour"]}
    shaped = hf.text_generation("A colour as JSON:", max_new_tokens=40, grammar={"type": "json", "value": schema})
    assert isinstance(json.loads(shaped)["colour"], str)


def test_bad_parameters_are_validation_errors_naming_them(hf, cluster):
    for kwargs, name in (({"max_new_tokens": 10**7}, "parameters.max_new_tokens"), ({"best_of": 2}, "parameters.best_of"),
                         ({"typical_p": 0.5}, "parameters.typical_p")):
        with pytest.raises(ValidationError, match=name.replace(".", r"\.")):
            hf.text_generation(PROMPT, **kwargs)
    router = cluster.config.router
    info = json.loads(urllib.request.urlopen(f"http://{router.host}:{router.http_port}/info", timeout=30).read())
    assert info["model_id"] and info["max_total_tokens"] > info["max_input_tokens"] > 0
