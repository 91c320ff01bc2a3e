import pytest

from services.common.step import SamplingParams


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
