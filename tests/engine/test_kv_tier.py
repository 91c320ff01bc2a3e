"""The worker's second KV tier (services/engine/kv_tier.py): blocks saved and loaded back hold
the same K/V bit for bit, in host memory and in a file; a request continuing on blocks loaded
into other pool blocks gets the logits of the same request computed cold (1e-4, fp32); copies
out of range are refused; measuring leaves the pool as it was. Tiny checkpoints, CPU."""
from __future__ import annotations

import random

import pytest
import torch

from services.engine.kv_tier import KVTier
from tests.engine.test_prefix_cache import BS, TOLERANCE, kv_of, logits, tokens
from tests.tiny_models import make_engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir, block_size=BS, dtype="float32")


@pytest.mark.parametrize("on_disk", [False, True])
def test_saved_blocks_come_back_bit_for_bit(engine, tmp_path, on_disk):
    path = str(tmp_path / "tier" / "kv.bin") if on_disk else None
    tier = KVTier(engine.cache, 6, path)
    for tensor in (*engine.cache.keys, *engine.cache.values):
        tensor.copy_(torch.randn_like(tensor))
    before = kv_of(engine, [3, 5, 9])
    # In order: save 3 and 5, load 5's copy into 7, save 9 into the slot 3 was in after loading
    # 3's copy into 2 (a slot freed by a load and written in the same plan).
    tier.copy([3, 5, 7, 2, 9], [0, 1, 1, 0, 0], [False, False, True, True, False])
    for tensor in (*engine.cache.keys, *engine.cache.values):
        tensor.view(engine.cache.num_blocks, -1)[[3, 5]] = 0.0
    after = kv_of(engine, [2, 7, 9])
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert (tier.saved, tier.loaded) == (3, 2)
    if on_disk:
        assert (tmp_path / "tier" / "kv.bin").stat().st_size == tier.nbytes


def test_a_prefix_loaded_into_other_blocks_gives_the_cold_logits(engine):
    rng = random.Random(5)
    ids = tokens(rng, 3 * BS + 7)
    tier = KVTier(engine.cache, 4)
    first = [10, 11, 12, 13]
    logits(engine, 1, ids, 0, first)                  # computes the prefix into blocks 10-12
    tier.copy(first[:3], [2, 0, 3], [False] * 3)      # the pool evicts them
    for tensor in (*engine.cache.keys, *engine.cache.values):
        tensor.view(engine.cache.num_blocks, -1)[first] = float("nan")   # and gives them out again
    loaded = [20, 4, 17]
    tier.copy(loaded, [2, 0, 3], [True] * 3)
    warm = logits(engine, 2, ids, 3 * BS, loaded + [21])
    cold = logits(engine, 3, ids, 0, [30, 31, 32, 33])[3 * BS:]
    assert (warm - cold).abs().max().item() <= TOLERANCE


def test_copies_out_of_range_are_refused(engine):
    tier = KVTier.sized(engine.cache, 3 * engine.cache.spec.bytes_per_block + 1)
    assert tier.num_slots == 3
    assert KVTier.sized(engine.cache, engine.cache.spec.bytes_per_block - 1) is None
    with pytest.raises(ValueError, match="slot 3"):
        tier.check([0], [3])
    with pytest.raises(ValueError, match=f"block {engine.cache.num_blocks}"):
        tier.check([engine.cache.num_blocks], [0])
    with pytest.raises(ValueError, match="2 blocks for 1 slots"):
        tier.check([0, 1], [0])


def test_measuring_leaves_the_pool_as_it_was(engine):
    tier = KVTier(engine.cache, 8)
    for tensor in (*engine.cache.keys, *engine.cache.values):
        tensor.copy_(torch.randn_like(tensor))
    before = kv_of(engine, list(range(8)))
    seconds = tier.measure(blocks=8)
    assert 0 < seconds < 1
    assert all(torch.equal(a, b) for a, b in zip(before, kv_of(engine, list(range(8)))))
    assert (tier.saved, tier.loaded) == (0, 0)
