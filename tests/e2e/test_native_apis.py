"""The native APIs of the other servers, on the session's fp32 cluster. Hugging Face TGI's through
huggingface_hub's InferenceClient (the client TGI's users call it with): the greedy text and each
token's id and logprob equal our completions endpoint's for the same prompt; a stream's tokens
add up to its text, the last with the details; a stop sequence kept; a JSON grammar followed;
bad parameters are TGI's validation errors; /info names the model; decoder_input_details the
prompt's tokens and logprobs. SGLang's /generate as its
docs call it (JSON over HTTP): text or token ids in, text, ids and logprobs out equal to the
completions endpoint's; a batch; the cumulative stream; errors naming sampling_params."""
from __future__ import annotations

import json
import urllib.error
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


def test_decoder_input_details_are_the_prompts_tokens_and_logprobs(hf, client, model):
    """TGI's prefill: the input's tokens, the first's logprob null and each other's given those
    before it, equal to the completions endpoint's echoed prompt logprobs."""
    out = hf.text_generation(PROMPT, max_new_tokens=2, details=True, decoder_input_details=True)
    ours = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0, echo=True,
                                     extra_body={"return_token_ids": True})
    prompt = ours.choices[0].prompt_token_ids
    assert [t.id for t in out.details.prefill] == prompt
    assert out.details.prefill[0].logprob is None
    assert [t.logprob for t in out.details.prefill[1:]] == pytest.approx(
        ours.choices[0].logprobs.token_logprobs[1:len(prompt)], abs=1e-5)
    assert "".join(t.text for t in out.details.prefill) == PROMPT


def test_langchains_defaults_are_served_and_a_seed_repeats_the_answer(hf):
    """LangChain's HuggingFaceEndpoint defaults (top_p 0.95, typical_p 0.95, temperature 0.8):
    sampled, a seed gives the same text again; a small typical_p samples only typical tokens, a
    seed again the same."""
    defaults = {"max_new_tokens": 16, "top_p": 0.95, "typical_p": 0.95, "temperature": 0.8, "seed": 11}
    assert hf.text_generation(PROMPT, **defaults) == hf.text_generation(PROMPT, **defaults)
    narrow = {**defaults, "typical_p": 0.2, "seed": 5}
    assert hf.text_generation(PROMPT, **narrow) == hf.text_generation(PROMPT, **narrow)


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
                         ({"typical_p": 1.5}, "parameters.typical_p")):
        with pytest.raises(ValidationError, match=name.replace(".", r"\.")):
            hf.text_generation(PROMPT, **kwargs)
    router = cluster.config.router
    info = json.loads(urllib.request.urlopen(f"http://{router.host}:{router.http_port}/info", timeout=30).read())
    assert info["model_id"] and info["max_total_tokens"] > info["max_input_tokens"] > 0


def native(cluster, body: dict) -> tuple[int, object]:
    router = cluster.config.router
    request = urllib.request.Request(f"http://{router.host}:{router.http_port}/generate", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            raw = answer.read().decode()
            return answer.status, (json.loads(raw) if not body.get("stream") else raw)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_sglang_generate_answers_as_the_completion_endpoint(cluster, client, model):
    ids = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"return_token_ids": True}) \
        .choices[0].prompt_token_ids
    status, out = native(cluster, {"input_ids": ids, "sampling_params": {"max_new_tokens": 10, "temperature": 0},
                                   "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True})
    ours = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=0,
                                     extra_body={"return_token_ids": True})
    assert status == 200 and out["text"] == ours.choices[0].text and out["output_ids"] == ours.choices[0].token_ids
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 10
    assert meta["finish_reason"] == {"type": "length", "length": 10}
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(ours.choices[0].logprobs.token_logprobs,
                                                                                abs=1e-5)
    assert [i for _, i, _ in meta["input_token_logprobs"]] == ids and meta["input_token_logprobs"][0][0] is None
    status, batch = native(cluster, {"text": [PROMPT, "Hello"], "sampling_params": {"max_new_tokens": 10, "temperature": 0}})
    assert status == 200 and [b["text"] for b in batch][0] == out["text"] and len(batch) == 2
    status, stream = native(cluster, {"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 10,
                                                                                         "temperature": 0}})
    events = [json.loads(line.removeprefix("data: ")) for line in stream.split("\n\n") if line.startswith("data: {")]
    assert stream.rstrip().endswith("data: [DONE]") and events[-1]["text"] == out["text"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(events, events[1:]))       # cumulative, as SGLang's
    status, refused = native(cluster, {"text": PROMPT, "sampling_params": {"max_new_tokens": 10**7}})
    assert status == 400 and refused["error"]["param"] == "sampling_params.max_new_tokens"
    status, refused = native(cluster, {"text": PROMPT, "image_data": "http://x/y.png"})
    assert status == 400 and refused["error"]["param"] == "image_data"
