"""Sampling: seeded requests reproduce alone and in any batch; filters and temperature behave."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from services.common.step import SamplingParams
from services.engine.batch_runner import BatchRunner, GenerationRequest
from services.engine.sampler import argmax_rows, sample
from tests.tiny_models import make_engine

SEEDED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=24,
                        ignore_eos=True)


def generate(engine, requests, max_running):
    return [r.token_ids for r in BatchRunner(engine, max_running=max_running,
                                             max_step_tokens=64).run(requests)]


def test_seeded_sampling_same_alone_and_in_a_batch(tiny_model_dir):
    prompt = list(range(40, 75))
    alone = generate(make_engine(tiny_model_dir), [GenerationRequest(prompt, SEEDED)], 1)[0]

    others = [GenerationRequest(list(range(5, 5 + n)), SamplingParams(
        temperature=t, seed=None, max_tokens=m, ignore_eos=True))
        for n, t, m in [(90, 1.0, 30), (12, 0.0, 10), (50, 0.7, 40), (3, 1.3, 24)]]
    batch = others[:2] + [GenerationRequest(prompt, SEEDED)] + others[2:]
    in_batch = generate(make_engine(tiny_model_dir, seed=99), batch, len(batch))[2]
    assert len(alone) == 24
    assert in_batch == alone


def test_different_seeds_differ_and_sampling_is_not_greedy(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = list(range(40, 75))
    runs = generate(engine, [GenerationRequest(prompt, SamplingParams(
        temperature=1.0, seed=s, max_tokens=24, ignore_eos=True)) for s in range(4)]
        + [GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))], 5)
    assert len({tuple(r) for r in runs}) == 5


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.5, top_k=1)] * 3 + [SamplingParams(temperature=1.5, top_p=1e-6)] * 3
    tokens = sample(logits, params, [0] * 6, torch.Generator().manual_seed(1))
    assert tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(temperature=1.0), None),
    (SamplingParams(temperature=0.5), None),
    (SamplingParams(temperature=1.0, top_k=3), {0, 1, 2}),
    (SamplingParams(temperature=1.0, top_p=0.6), {0, 1}),
])
def test_frequencies_follow_the_filtered_distribution(params, allowed):
    # Token i has logit -0.5 * i: probabilities fall off geometrically.
    logits = torch.tensor([[-0.5 * i for i in range(8)]])
    tempered = logits[0] / params.temperature
    keep = torch.tensor([allowed is None or i in allowed for i in range(8)])
    expected = tempered.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    generator = torch.Generator().manual_seed(7)
    draws = 4000
    counts = Counter(sample(logits.repeat(draws, 1), [params] * draws, [0] * draws, generator))
    for token in range(8):
        p = expected[token].item()
        # 5 standard deviations of a binomial count: fails on a wrong distribution, not on noise.
        assert abs(counts[token] - draws * p) <= 5 * math.sqrt(draws * p * (1 - p)) + 1e-9, (token, counts)


@pytest.mark.parametrize("vocab", [49152, 32000, 151936, 50257, 1000, 300])
def test_argmax_rows_picks_what_argmax_picks(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=generator)
    # Ties, first occurrence wins: in one chunk, across chunks, and between the body and the tail.
    logits[1, 5] = logits[1, 9] = 100.0
    logits[2, 3] = logits[2, vocab // 2] = 100.0
    logits[3, vocab - 1] = logits[3, 0] = 100.0
    logits[4, vocab - 1] = 100.0                     # the maximum in the last (partial) chunk
    logits[5] = 0.0                                  # all equal
    logits[6, :] = -torch.inf
    logits[6, vocab - 2] = 1.0
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def filter_by_full_sort(logits, top_k, top_p):
    """The top-k / nucleus filter written plainly over whole sorted rows (the reference)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k])
    remove = torch.arange(vocab).unsqueeze(0) >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    p = torch.tensor(top_p).unsqueeze(1)
    remove |= ((probs.cumsum(dim=-1) - probs) >= p) & (p < 1)
    remove[:, 0] = False
    return logits.masked_fill(torch.zeros_like(remove).scatter_(1, order, remove), float("-inf"))


def test_the_filter_keeps_what_sorting_whole_rows_keeps():
    """Rows whose top-k or nucleus closes within the sorted candidates, a top-k wider than them,
    a flat row whose nucleus does not close there (sorted whole), and an unfiltered row beside."""
    from services.engine.sampler import CANDIDATES, _filter_top_k_top_p
    generator = torch.Generator().manual_seed(3)
    vocab = 4 * CANDIDATES[-1] + 17
    logits = torch.randn(7, vocab, generator=generator) * 4
    logits[4] = torch.randn(vocab, generator=generator) * 0.01          # nearly flat
    logits[5, :10] = float("-inf")                                       # masked tokens
    top_k = [0, 40, CANDIDATES[-1] + 500, 0, 0, 7, 0]
    top_p = [0.9, 1.0, 0.97, 1.0, 0.99, 0.5, 0.3]
    got = _filter_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(got, filter_by_full_sort(logits, top_k, top_p))
    kept = (got > float("-inf")).sum(dim=-1).tolist()
    assert kept[1] == 40 and kept[3] == vocab and kept[4] > CANDIDATES[-1]    # the row sorted whole


def test_a_token_of_probability_0_is_never_drawn_even_at_the_ends():
    from services.engine.sampler import _inverse_cdf
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    draws = torch.tensor([0.0, 0.5, 1.0 - 1e-16, 0.25], dtype=torch.float64)
    assert _inverse_cdf(probs, draws).tolist() == [1, 3, 3, 1]
