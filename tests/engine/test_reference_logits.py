"""The engine's logits equal transformers' on the same weights (fp32, CPU, max abs diff < 1e-4),
however the work is split into steps and wherever the KV blocks live. With QOS_TEST_DEVICE=cuda
or npu the engine runs there (the reference stays on the CPU), within 1e-3: GPU kernels sum in
other orders."""
from __future__ import annotations

import random

import pytest
import torch

from services.common.step import SequenceWork, StepBatch
from tests.engine.conftest import LOGIT_DIFFS, TEST_DEVICE
from tests.tiny_models import reference_logits

TOLERANCE = 1e-4 if TEST_DEVICE == "cpu" else 1e-3
VOCAB = 512


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    diff = (got.float().cpu() - want).abs().max().item()
    LOGIT_DIFFS.append(diff)
    assert diff < TOLERANCE, f"max abs diff {diff:.3g}"


def test_whole_prompt_prefill(device_engine, tiny_reference):
    tokens = random_tokens(random.Random(1), 100)
    got = device_engine.compute_logits(StepBatch([SequenceWork(7, tokens, 0, list(range(7)))]))[7]
    assert_close(got, reference_logits(tiny_reference, tokens))


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill(device_engine, tiny_reference, chunk):
    tokens = random_tokens(random.Random(chunk), 150)
    table = list(range(10))
    pieces = []
    for start in range(0, len(tokens), chunk):
        batch = StepBatch([SequenceWork(1, tokens[start:start + chunk], start, table)])
        pieces.append(device_engine.compute_logits(batch)[1])
    assert_close(torch.cat(pieces), reference_logits(tiny_reference, tokens))


def test_shuffled_noncontiguous_block_tables(device_engine, tiny_reference):
    rng = random.Random(5)
    num_blocks = device_engine.kv_spec.num_blocks
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    # Two sequences whose blocks interleave all over the cache, in descending and random order.
    table_a = sorted(ids[:8], reverse=True)
    table_b = ids[8:16]
    tokens_a, tokens_b = random_tokens(rng, 120), random_tokens(rng, 90)
    for start in range(0, 120, 50):
        batch = [SequenceWork(1, tokens_a[start:start + 50], start, table_a)]
        if start < 90:
            batch.append(SequenceWork(2, tokens_b[start:start + 50], start, table_b))
        got = device_engine.compute_logits(StepBatch(batch))
        assert_close(got[1], reference_logits(tiny_reference, tokens_a)[start:start + 50])
        if start < 90:
            assert_close(got[2], reference_logits(tiny_reference, tokens_b)[start:start + 50])


def test_mixed_batch_of_prefills_and_decodes(device_engine, tiny_reference):
    """3 prefills of different lengths (one whole, two mid-prompt chunks) beside 5 decodes."""
    rng = random.Random(9)
    free_blocks = list(range(device_engine.kv_spec.num_blocks))
    rng.shuffle(free_blocks)

    def take(n: int) -> list[int]:
        return [free_blocks.pop() for _ in range(n)]

    decoders = {}
    for seq_id in range(10, 15):
        context = random_tokens(rng, rng.randrange(5, 60))
        table = take(5)
        device_engine.compute_logits(StepBatch([SequenceWork(seq_id, context, 0, table)]))
        decoders[seq_id] = (context, table, rng.randrange(3, VOCAB))

    prompts = {20: random_tokens(rng, 33), 21: random_tokens(rng, 70), 22: random_tokens(rng, 9)}
    tables = {seq_id: take(5) for seq_id in prompts}
    # Sequences 21 and 22 already have their first tokens cached: this step continues their prompts.
    done = {20: 0, 21: 40, 22: 4}
    for seq_id in (21, 22):
        device_engine.compute_logits(StepBatch([SequenceWork(seq_id, prompts[seq_id][:done[seq_id]], 0,
                                                           tables[seq_id])]))

    batch = [SequenceWork(s, p[done[s]:], done[s], tables[s]) for s, p in prompts.items()]
    batch += [SequenceWork(s, [token], len(context), table)
              for s, (context, table, token) in decoders.items()]
    random.Random(3).shuffle(batch)
    got = device_engine.compute_logits(StepBatch(batch))

    for seq_id, prompt in prompts.items():
        assert_close(got[seq_id], reference_logits(tiny_reference, prompt)[done[seq_id]:])
    for seq_id, (context, _, token) in decoders.items():
        assert_close(got[seq_id], reference_logits(tiny_reference, context + [token])[-1:])


def test_step_samples_only_where_asked(device_engine):
    rng = random.Random(2)
    prompt = random_tokens(rng, 30)
    out = device_engine.step(StepBatch([
        SequenceWork(1, prompt[:20], 0, [0, 1], sample=False),   # a prompt's first chunk
        SequenceWork(2, prompt, 0, [2, 3]),
    ]))
    assert [t.seq_id for t in out.tokens] == [2]
    assert out.forward_seconds > 0
