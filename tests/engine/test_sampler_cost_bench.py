"""bench/sampler_cost.py: another commit's sampler imported beside this checkout's, and the
nucleus sizes it reports."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from bench import sampler_cost
from services.common.step import SamplingParams
from services.engine import sampler

ROOT = Path(__file__).resolve().parents[2]


def test_a_commits_sampler_is_its_own_module_and_samples(tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout: no commit to take the other sampler from")
    other = sampler_cost.sampler_of("HEAD", tmp_path)
    assert other is not sampler and other.__file__.startswith(str(tmp_path))
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    greedy = [SamplingParams(temperature=0.0)] * 4
    assert other.sample(logits, greedy, [0] * 4, torch.Generator()) == logits.argmax(dim=-1).tolist()


def test_nucleus_sizes_count_the_tokens_top_p_keeps():
    # Probabilities 0.5, 0.25, 0.125, ...: top_p 0.7 keeps 2 tokens, 0.9 keeps 4.
    logits = torch.tensor([[-0.6931 * i for i in range(12)]])
    assert sampler_cost.nucleus_sizes(logits, SamplingParams(temperature=1.0, top_p=0.7)) == [2, 2, 2]
    assert sampler_cost.nucleus_sizes(logits, SamplingParams(temperature=1.0, top_p=0.9)) == [4, 4, 4]
