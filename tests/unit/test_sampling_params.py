import pytest

from services.common.proto.qos.v1 import common_pb2
from services.common.step import SamplingParams
from services.common.wire import client_adjustments, engine_sampling, sampling_from_engine, sampling_from_request


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"max_tokens": 0}, "max_tokens must be > 0"),
])
def test_invalid_parameters_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_greedy_means_zero_temperature():
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy


@pytest.mark.parametrize("kwargs, message", [
    ({"allowed_token_ids": tuple(range(4097))}, "allowed_token_ids may name at most 4096 tokens, got 4097"),
    ({"allowed_token_ids": (5, -1, 7)}, "allowed_token_ids must be token ids >= 0, got -1"),
    ({"allowed_token_ids": (5,), "json_schema": '{"type": "object"}'},
     "allowed_token_ids and json_schema both say which tokens may come"),
    ({"allowed_token_ids": (5,), "regex": "a+"}, "allowed_token_ids and regex both say"),
    ({"allowed_token_ids": (5,), "choice": ("yes", "no")}, "allowed_token_ids and choice both say"),
    ({"allowed_token_ids": (5,), "grammar": 'start: "yes"'}, "allowed_token_ids and grammar both say"),
])
def test_allowed_token_ids_out_of_bounds_or_beside_a_structured_output_are_refused_by_name(kwargs, message):
    # The router reports the message's first word as the field.
    with pytest.raises(ValueError, match=message) as refused:
        SamplingParams(**kwargs)
    assert str(refused.value).split()[0] == "allowed_token_ids"


def test_allowed_token_ids_up_to_the_bound_and_repeated_are_kept_as_sent():
    assert len(SamplingParams(allowed_token_ids=tuple(range(4096))).allowed_token_ids) == 4096
    params = SamplingParams(allowed_token_ids=(9, 0, 9))
    assert params.allowed_token_ids == (9, 0, 9) and params.penalised    # the sampler adjusts its row
    assert not SamplingParams().penalised


def test_allowed_token_ids_cross_every_hop():
    # Client proto -> ours (scheduler intake), ours -> EngineSampling -> ours (scheduler -> worker).
    client = common_pb2.SamplingParams(temperature=0.0, allowed_token_ids=[42, 7, 42], logit_bias={7: 1.5})
    ours = sampling_from_request(client, 8)
    assert ours.allowed_token_ids == (42, 7, 42) and ours.logit_bias == ((7, 1.5),)
    assert list(engine_sampling(ours).allowed_token_ids) == [42, 7, 42]
    assert sampling_from_engine(engine_sampling(ours)) == ours
    assert client_adjustments(client)["allowed_token_ids"] == (42, 7, 42)     # the router's check sees them
    assert sampling_from_request(common_pb2.SamplingParams(), 8).allowed_token_ids == ()
    with pytest.raises(ValueError, match="allowed_token_ids and regex both say"):
        sampling_from_request(common_pb2.SamplingParams(allowed_token_ids=[1], regex="a+"), 8)
