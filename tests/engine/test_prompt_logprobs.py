"""Prompt logprobs (a completion's `echo` with `logprobs`): each prompt token's log-probability
given the tokens before it, from the sequence's own rows, equal to the log-softmax of the
reference model's logits at the position before it; the same whether the prompt is computed in
one step or in chunks, and whatever else shares the step; the top tokens are the likeliest."""
from __future__ import annotations

import pytest

from services.common.step import SamplingParams, SequenceWork, StepBatch
from services.engine.engine import InvalidStepError
from tests.tiny_models import make_engine, reference_logits

PROMPT = [5, 17, 3, 99, 42, 8, 61, 7, 23, 11, 4, 90, 33, 2, 71, 15, 50, 9, 27]
ASKS = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3)


def run_chunks(engine, prompt, cuts, seq_id=1, others=()):
    """The prompt through `engine` in chunks ending at `cuts`, asking prompt logprobs; its
    entries by position, and the other sequences' outputs."""
    table = list(range(seq_id * 8, seq_id * 8 + 4))
    got, start = {}, 0
    for end in cuts:
        entry = SequenceWork(seq_id, prompt[start:end], start, table, sampling=ASKS, sample=end == len(prompt),
                             prompt_targets=prompt[start + 1:min(end + 1, len(prompt))])
        output = engine.step(StepBatch([entry, *others]))
        for p in output.prompt_logprobs:
            assert p.seq_id == seq_id
            for i, (token, e) in enumerate(zip(p.token_ids, p.entries)):
                got[p.first_position + i] = (token, e)
        start = end
    return got


def test_each_prompt_token_gets_the_references_logprob_in_one_step_or_in_chunks(tiny_engine, tiny_reference):
    expected = reference_logits(tiny_reference, PROMPT).log_softmax(-1)
    whole = run_chunks(tiny_engine, PROMPT, [len(PROMPT)])
    assert sorted(whole) == list(range(1, len(PROMPT)))          # every token but the first
    for position, (token, entry) in whole.items():
        assert token == PROMPT[position]
        assert entry.logprob == pytest.approx(expected[position - 1, token].item(), abs=1e-4)
        top_ids = [t for t, _ in entry.top]
        assert len(top_ids) == 3 and top_ids == expected[position - 1].topk(3).indices.tolist()
        # its rank (vLLM's prompt_logprobs): 1 + the tokens likelier than it, those within the
        # logprobs' tolerance of it either way (the tiny model's distribution is nearly flat)
        row, own = expected[position - 1], expected[position - 1, token]
        assert 1 + int((row > own + 1e-4).sum()) <= entry.rank <= 1 + int((row > own - 1e-4).sum())
    assert len({e.rank for _, e in whole.values()}) > 5


def test_chunks_and_company_change_nothing(tiny_model_dir, tiny_reference):
    expected = run_chunks(make_engine(tiny_model_dir), PROMPT, [len(PROMPT)])
    chunked = run_chunks(make_engine(tiny_model_dir), PROMPT, [5, 16, len(PROMPT)])
    other = SequenceWork(2, [1, 2, 3, 4], 0, [40, 41], sampling=SamplingParams(temperature=0.0))
    shared = run_chunks(make_engine(tiny_model_dir), PROMPT, [7, len(PROMPT)], others=[other])
    for got in (chunked, shared):
        assert sorted(got) == sorted(expected)
        for position, (token, entry) in got.items():
            assert token == expected[position][0]
            assert entry.logprob == pytest.approx(expected[position][1].logprob, abs=1e-5)


def test_a_sequence_that_does_not_ask_pays_nothing_and_bad_targets_are_refused(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    plain = SequenceWork(1, PROMPT, 0, [0, 1], sampling=SamplingParams(temperature=0.0))
    assert engine.step(StepBatch([plain])).prompt_logprobs == []
    for targets in (PROMPT * 2, [10**7]):
        with pytest.raises(InvalidStepError):
            engine.step(StepBatch([SequenceWork(2, PROMPT, 0, [2, 3], sampling=ASKS, prompt_targets=targets)]))
