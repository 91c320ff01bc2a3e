"""The check the fault tests rely on in bf16 (bench/continuation.py): a greedy stream the engine
really produced passes it, batched or alone, in either dtype; the same stream with one token
dropped or one repeated fails it there (at that token, or a few later where it is a near-tie)."""
from __future__ import annotations

import random

import pytest

from bench.continuation import GreedyChecker, first_difference
from services.common.step import SamplingParams
from services.engine.batch_runner import BatchRunner, GenerationRequest
from tests.tiny_models import make_engine, write_tiny_model

VOCAB = 512
TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A spread at which every layer shapes the logits (tests/engine/test_bf16.py says why).
    return write_tiny_model(tmp_path_factory.mktemp("continuation"), "llama", init_std=0.2)


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 40))] for _ in range(count)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_streams_batched_or_alone_pass_and_a_dropped_or_repeated_token_fails(model_dir, dtype):
    engine = make_engine(model_dir, num_blocks=256, dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    asked = prompts(12)
    batched = BatchRunner(engine, max_running=12, max_step_tokens=48).run(
        [GenerationRequest(p, params) for p in asked])
    alone = [BatchRunner(engine, max_running=1).run([GenerationRequest(p, params)])[0] for p in asked]
    checker = GreedyChecker(str(model_dir), dtype)
    mutated = 0
    for prompt, a, b in zip(asked, batched, alone):
        assert checker.broken_at(prompt, a.token_ids) is None
        assert checker.broken_at(prompt, b.token_ids) is None
        tokens = b.token_ids
        for k in range(1, TOKENS - 1):
            if len({tokens[k - 1], tokens[k], tokens[k + 1]}) == 3:      # a drop or a repeat changes the text here
                dropped = tokens[:k] + tokens[k + 1:]
                repeated = tokens[:k] + [tokens[k - 1]] + tokens[k:]
                # Caught at the mutation or, where its token happens to be a near-tie there,
                # at one of the next few, whose text no longer follows.
                for broken in (checker.broken_at(prompt, dropped), checker.broken_at(prompt, repeated)):
                    assert broken is not None and k <= broken < k + 8
                mutated += 1
                break
    assert mutated >= 10


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
