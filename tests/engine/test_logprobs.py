"""Logprobs come from the logits the token was sampled from, only for sequences that ask for them."""
from __future__ import annotations

import math

import pytest
import torch

from services.common.step import SamplingParams, SequenceWork, StepBatch
from services.engine.sampler import logprob_rows, token_logprobs
from tests.tiny_models import make_engine

ASKS = {1: SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=5),
        2: SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True),           # asks nothing
        3: SamplingParams(temperature=1.2, seed=7, max_tokens=64, ignore_eos=True, logprobs=0),
        4: SamplingParams(temperature=0.7, top_k=3, max_tokens=64, ignore_eos=True, logprobs=20)}
PROMPTS = {1: list(range(10, 40)), 2: list(range(50, 57)), 3: list(range(100, 119)), 4: [5, 9, 33]}


def run_mixed_batch(engine, steps: int):
    """Every sequence prefilled in one step, then decoded together; returns each sequence's
    tokens (prompt + generated) and the logprobs of each generated token."""
    tokens = {s: list(p) for s, p in PROMPTS.items()}
    tables = {s: list(range(8 * (s - 1), 8 * s)) for s in PROMPTS}
    logprobs = {s: [] for s in PROMPTS}
    computed = {s: 0 for s in PROMPTS}
    for _ in range(steps):
        batch = StepBatch([SequenceWork(s, tokens[s][computed[s]:], computed[s], tables[s], ASKS[s],
                                        num_generated=len(tokens[s]) - len(PROMPTS[s]))
                           for s in PROMPTS])
        for work in batch.sequences:
            computed[work.seq_id] = work.end
        for token in engine.step(batch).tokens:
            tokens[token.seq_id].append(token.token_id)
            logprobs[token.seq_id].append(token.logprobs)
    return tokens, logprobs


def test_logprobs_match_a_recomputed_log_softmax_within_1e_4_fp32(tiny_model_dir):
    engine = make_engine(tiny_model_dir, dtype="float32")
    tokens, logprobs = run_mixed_batch(engine, steps=6)
    assert all(lp is None for lp in logprobs[2])         # it did not ask: nothing computed
    fresh = make_engine(tiny_model_dir, dtype="float32")
    worst = 0.0
    for seq_id in (1, 3, 4):
        full = tokens[seq_id]
        # The whole sequence at once, in another engine: position i's logits predict token i + 1.
        logits = fresh.compute_logits(StepBatch([SequenceWork(seq_id, full, 0, list(range(8)))]))[seq_id]
        reference = logits.double().log_softmax(dim=-1)
        start = len(PROMPTS[seq_id])
        for i, got in enumerate(logprobs[seq_id]):
            row = reference[start - 1 + i]
            worst = max(worst, abs(got.logprob - row[full[start + i]].item()))
            k = ASKS[seq_id].logprobs
            assert len(got.top) == k
            best = row.topk(k) if k else None
            for (token_id, value), ref_value, ref_id in zip(got.top, *(best or ((), ()))):
                worst = max(worst, abs(value - ref_value.item()))
                assert token_id == ref_id.item() or abs(row[token_id].item() - ref_value.item()) < 1e-4
            if ASKS[seq_id].greedy:
                assert got.top[0][0] == full[start + i]      # the greedy token is the most likely
    assert worst < 1e-4


def test_top_logprobs_skip_tokens_a_mask_made_impossible():
    logits = torch.tensor([[0.0, 1.0, float("-inf"), 2.0], [3.0, float("-inf"), float("-inf"), float("-inf")]])
    params = [SamplingParams(logprobs=4), SamplingParams(logprobs=3)]
    first, second = token_logprobs(logprob_rows(logits, params), [3, 0], params)
    assert [t for t, _ in first.top] == [3, 1, 0] and second.top == ((0, 0.0),)
    total = math.log(1 + math.e + math.e ** 2)
    assert first.logprob == pytest.approx(2 - total, abs=1e-6) and second.logprob == 0.0
