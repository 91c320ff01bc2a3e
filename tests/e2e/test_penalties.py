"""Logit bias, presence / frequency / repetition penalties, min_p and min_tokens through both
fronts, with the official `openai` client, against a real cluster serving the embedded model in
fp32: the answer is token for token what the engine gives for the same prompt and parameters
(greedy), it differs from the unpenalised one, a bias of 100 forces its token, min_tokens holds
off an EOS so forced, and out-of-range values or a token past the vocabulary are 400 /
INVALID_ARGUMENT naming the parameter."""
from __future__ import annotations

import functools

import grpc
import openai
import pytest

from services.common.proto.qos.v1 import router_pb2
from services.common.step import SamplingParams
from services.common.tokenizer import TextTokenizer
from services.engine.batch_runner import BatchRunner, GenerationRequest
from services.engine.default_model import default_model_dir
from services.tools.client import RouterClient, sampling_params
from tests.e2e.conftest import run

pytestmark = pytest.mark.slow

PROMPT = "The list of fruits: apple, banana, apple, banana,"
ADJUSTED = dict(presence_penalty=1.5, frequency_penalty=0.8, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def cluster(fp32_cluster):
    return fp32_cluster         # exact tokens: fp32 (the session's shared cluster, tests/e2e/conftest.py)


@functools.cache
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_model_dir(default_model_dir(progress=False))


def engine_tokens(max_tokens: int, **adjustments) -> list[int]:
    """What the engine alone samples for PROMPT, greedy, in fp32."""
    from tests.tiny_models import make_engine
    engine = make_engine(default_model_dir(progress=False), num_blocks=64, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **adjustments)
    [result] = BatchRunner(engine, max_running=1).run([GenerationRequest(tokenizer().encode(PROMPT), params)])
    return result.token_ids


def test_grpc_answers_are_the_engines_own_tokens_and_differ_from_unpenalised(cluster):
    async def go(**adjustments):
        request = sampling_params(max_tokens=16, temperature=0.0, ignore_eos=True, **adjustments)
        async with RouterClient(cluster.router_address) as c:
            return (await c.generate(router_pb2.GenerateRequest(prompt=PROMPT, sampling=request))).token_ids

    penalised = run(go(**ADJUSTED))
    assert penalised == engine_tokens(16, **ADJUSTED)
    assert penalised != run(go())


def test_the_official_client_sends_them_and_gets_the_engines_answer(client, model):
    bias = {tokenizer().encode(" cherry")[0]: 4.0}
    answer = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, presence_penalty=ADJUSTED["presence_penalty"],
        frequency_penalty=ADJUSTED["frequency_penalty"], logit_bias={str(k): v for k, v in bias.items()},
        extra_body={"repetition_penalty": ADJUSTED["repetition_penalty"], "min_p": 0.05, "ignore_eos": True})
    expected = engine_tokens(12, logit_bias=tuple(bias.items()), **ADJUSTED)
    assert answer.choices[0].text == tokenizer().decode(expected)
    assert answer.usage.completion_tokens == 12


def test_a_bias_of_100_forces_its_token_in_a_chat(client, model):
    forced = tokenizer().encode(" sea")[0]
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=5, temperature=0, logit_bias={str(forced): 100})
    assert answer.choices[0].message.content == tokenizer().decode([forced] * 5)


def test_min_tokens_holds_off_eos_through_the_official_client(client, model):
    from services.engine.config import load_model_config
    eos = load_model_config(default_model_dir(progress=False)).eos_token_ids[0]

    def ask(**extra):
        answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0,
                                           logit_bias={str(eos): 100}, extra_body=extra)
        return answer.choices[0].finish_reason, answer.usage.completion_tokens

    at_once = ask()
    assert at_once[0] == "stop" and at_once[1] <= 1          # EOS first: nothing to say
    assert ask(min_tokens=6) == ("stop", at_once[1] + 6)      # six tokens, then the EOS


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"12": 101}}, "logit_bias[12]"), ({"logit_bias": {"one": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias[49152]"),       # past SmolLM2's vocabulary (49,152)
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": 1, "response_format": {"type": "json_object"}}, "min_tokens"),
])
def test_bad_values_are_400s_naming_the_parameter(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"max_tokens": 2, **extra})
    assert caught.value.param == param


@pytest.mark.parametrize("extra, field", [
    ({"presence_penalty": 3.0}, "sampling.presence_penalty"), ({"min_p": -1.0}, "sampling.min_p"),
    ({"repetition_penalty": 20.0}, "sampling.repetition_penalty"), ({"min_tokens": 3}, "sampling.min_tokens"),
    ({"logit_bias": {60000: 1.0}}, "sampling.logit_bias[60000]"), ({"logit_bias": {3: 500.0}}, "sampling.logit_bias[3]"),
])
def test_bad_values_over_grpc_are_invalid_argument_naming_the_field(cluster, extra, field):
    async def go():
        async with RouterClient(cluster.router_address) as c:
            await c.generate(router_pb2.GenerateRequest(prompt="Hi", sampling=sampling_params(max_tokens=2, **extra)))

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        run(go())
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in caught.value.details()
