"""bench/engine_vs_llamacpp.py without llama.cpp: it says how to get the binaries when they are
missing, and counts our engine's decode-only steps as llama.cpp counts its generation phase."""
from __future__ import annotations

import pytest

from bench import engine_vs_llamacpp as side_by_side
from bench.engine_workload import Request
from tests.tiny_models import make_engine


def test_missing_binaries_say_how_to_build_them(tmp_path, monkeypatch):
    monkeypatch.setenv("QOS_LLAMACPP_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="run `make llamacpp`"):
        side_by_side.find_llamacpp("SmolLM2-135M-Instruct", ["f32", "bf16"])


def test_decode_tokens_per_second_counts_decode_only_steps(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64)
    # Three 20-token prompts, 5 tokens each: the first step (512-token budget) prefills all three
    # and samples each one's first token, then come 4 decode-only steps.
    requests = [Request(list(range(100, 120)), 5) for _ in range(3)]
    result = side_by_side.ours_batched(engine, requests, batch=3)
    assert (result["steps"], result["decode_steps"]) == (5, 4)
    assert result["tok_s"] > 0 and result["e2e_tok_s"] > 0


def test_host_flags_name_the_ones_the_comparison_turns_on():
    flags = side_by_side.host_flags()
    assert {"avx2", "avx512_bf16", "amx_bf16"} <= set(flags) and all(isinstance(v, bool) for v in flags.values())
