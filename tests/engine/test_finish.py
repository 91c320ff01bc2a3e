"""Which sampled token ends a sequence, and why."""
from __future__ import annotations

import dataclasses

from services.common.step import FinishReason, SamplingParams, SequenceWork, StepBatch
from tests.tiny_models import make_engine


def greedy_next(engine, prompt, **sampling) -> tuple[int, FinishReason | None]:
    params = SamplingParams(temperature=0.0, **sampling)
    token = engine.step(StepBatch([SequenceWork(1, prompt, 0, list(range(8)), params)])).tokens[0]
    return token.token_id, token.finish_reason


def test_stop_tokens_eos_and_ignore_eos(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = list(range(3, 40))
    token, reason = greedy_next(engine, prompt)
    assert reason is None
    token_again, reason = greedy_next(engine, prompt, stop_token_ids=(token,))
    assert (token_again, reason) == (token, FinishReason.STOP)
    # Make the greedy token the model's EOS: then it stops, unless told to ignore EOS.
    engine.model_config = dataclasses.replace(engine.model_config, eos_token_ids=(token,))
    assert greedy_next(engine, prompt)[1] == FinishReason.STOP
    assert greedy_next(engine, prompt, ignore_eos=True)[1] is None
    assert greedy_next(engine, prompt, ignore_eos=True, stop_token_ids=(token,))[1] == FinishReason.STOP


def test_max_tokens_and_context_window(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=40)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    reasons = []
    for generated in range(3):
        work = SequenceWork(1, [7], 10 + generated, [0], params, num_generated=generated)
        reasons.append(engine.step(StepBatch([work])).tokens[0].finish_reason)
    assert reasons == [None, None, FinishReason.LENGTH]
    # A token computed at the last position of the 512-token window: its successor has no room.
    last = SequenceWork(2, [7], 511, list(range(32)), SamplingParams(temperature=0.0, ignore_eos=True))
    assert engine.step(StepBatch([last])).tokens[0].finish_reason == FinishReason.LENGTH
