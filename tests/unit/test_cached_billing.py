"""Cached prompt tokens (prefix caching) are billed at [billing] cached_prompt_fraction of a
computed token's price, and reported in OpenAI's usage shape."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.common.priority import HIGH, LOW
from services.common.proto.qos.v1 import common_pb2
from services.control.accounts import Accounts
from services.router.openai_api.response import usage_of

POOL = SimpleNamespace(name="cpu", device="cpu", cost=0.1)


@pytest.mark.parametrize("fraction, expected", [(0.5, (100 - 40 * 0.5 + 20) * 0.1 * 3.0),
                                                (1.0, 120 * 0.1 * 3.0), (0.0, 80 * 0.1 * 3.0)])
def test_cached_prompt_tokens_cost_their_fraction(fraction, expected):
    accounts = Accounts(book=None, ledger=None, multipliers=[3.0, 1.5, 1.0], cached_fraction=fraction)
    assert accounts.amount(POOL, HIGH, 120, cached=40) == pytest.approx(expected)   # 100 prompt + 20 completion
    assert accounts.amount(POOL, LOW, 120) == pytest.approx(12.0)                    # nothing cached: full price


def test_openai_usage_reports_cached_tokens():
    chunk = common_pb2.GenerateChunk(usage=common_pb2.Usage(prompt_tokens=100, completion_tokens=20, cached_tokens=64))
    assert usage_of(chunk) == {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120,
                               "prompt_tokens_details": {"cached_tokens": 64}}
