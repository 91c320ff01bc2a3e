"""Batch invariance (Engine.batch_invariant, the default where the kernels run:
services/engine/step_layout.py): a token's logits are the same bits however its prompt is chunked,
whatever else shares its step, and whether it is computed as a decode or recomputed inside a
prompt (a preempted or moved sequence), in fp32 and in bf16; the cache holds the same K/V either
way. The prompt path's pauses still come between pieces of a long chunk's attention."""
from __future__ import annotations

import random

import pytest
import torch

from services.common.step import SequenceWork, StepBatch
from services.engine.step_layout import batch_invariant_on_this_host
from tests.engine.conftest import require_decode_kernel_compiler
from tests.tiny_models import make_engine

VOCAB = 512
BLOCKS = 16          # per sequence: 256 tokens at block size 16


def invariant_engine(model_dir, dtype: str, **kwargs):
    require_decode_kernel_compiler("kernel")
    engine = make_engine(model_dir, num_blocks=4 * BLOCKS, dtype=dtype, **kwargs)
    if engine.dtype != {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]:
        pytest.skip(f"{dtype} is not this host's to run")
    assert engine.layouter.prompts_by_kernel
    if not engine.batch_invariant:
        pytest.skip(f"the linear kernel does not take {dtype} on this CPU (bf16 needs avx512_bf16)")
    assert batch_invariant_on_this_host(engine.dtype)
    return engine


def table(slot: int) -> list[int]:
    return list(range(slot * BLOCKS, (slot + 1) * BLOCKS))


def chunked(engine, tokens: list[int], sizes: list[int], slot: int, company: list[list[int]] = ()) -> torch.Tensor:
    """Logits of every position of `tokens` (sequence in `slot`), its prompt computed in chunks of
    `sizes` (the rest in the last); `company`: other prompts (slots 2, 3, ...) in its first step."""
    rows, start = [], 0
    bounds = [*sizes, len(tokens)]
    for index, size in enumerate(bounds):
        end = len(tokens) if index == len(bounds) - 1 else min(len(tokens), start + size)
        if end <= start:
            continue
        entries = [SequenceWork(1, tokens[start:end], start, table(slot))]
        if index == 0:
            entries += [SequenceWork(10 + i, other, 0, table(2 + i)) for i, other in enumerate(company)]
        rows.append(engine.compute_logits(StepBatch(entries))[1])
        start = end
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tokens_logits_do_not_depend_on_chunking_company_or_recompute(tiny_model_dir, dtype):
    engine = invariant_engine(tiny_model_dir, dtype)
    rng = random.Random(7)
    tokens = [rng.randrange(3, VOCAB) for _ in range(70)]
    company = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (45, 23)]
    whole = chunked(engine, tokens, [], slot=0)
    ways = {"chunks of 16, 5, 30": chunked(engine, tokens, [16, 5, 30], slot=1),
            "with two other prompts": chunked(engine, tokens, [33], slot=0, company=company),
            "one token a step (decodes)": chunked(engine, tokens, [1] * 69, slot=1),
            "a prompt, then decodes": chunked(engine, tokens, [40] + [1] * 29, slot=0)}
    for way, logits in ways.items():
        assert torch.equal(logits, whole), f"{way}: max abs diff {(logits - whole).abs().max().item():.3g}"
    # And the K/V the two slots hold are the same bits.
    first, second = (engine.cache.read(1, table(slot)[0] * 16 + torch.arange(70)) for slot in (0, 1))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("attention", [{"prompt_attention": "torch"}, {"decode_attention": "torch"}])
def test_with_either_attention_on_torch_it_does_not_hold_and_results_stay_correct(tiny_model_dir, attention):
    on = invariant_engine(tiny_model_dir, "float32", batch_invariant=True)
    off = make_engine(tiny_model_dir, num_blocks=4 * BLOCKS, dtype="float32", batch_invariant=True, **attention)
    assert not off.batch_invariant          # asked for, and a warning says it cannot hold
    assert (off.prompt_kernel is None) == ("prompt_attention" in attention) == (not off.layouter.prompts_by_kernel)
    rng = random.Random(3)
    tokens = [rng.randrange(3, VOCAB) for _ in range(50)]
    a, b = chunked(on, tokens, [20], slot=0), chunked(off, tokens, [20], slot=0)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * a.abs().max().item())


def test_a_long_chunk_pauses_between_pieces_of_its_attention(tiny_model_dir, monkeypatch):
    from services.engine import model
    engine = invariant_engine(tiny_model_dir, "float32")
    monkeypatch.setattr(model, "ATTENTION_PIECE_SCORES", 64 * 16)      # 16 rows a piece at 64 keys
    rng = random.Random(5)
    batch = StepBatch([SequenceWork(1, [rng.randrange(3, VOCAB) for _ in range(63)], 0, table(0))])
    pauses = []
    ordered, token_ids, layout = engine._prepare(batch)
    engine.model.forward(token_ids, layout, engine.cache, pause=lambda: pauses.append(1))
    layers = engine.model_config.num_layers
    assert len(pauses) == layers * 4 + (layers - 1)      # 4 pieces a layer, and between layers
