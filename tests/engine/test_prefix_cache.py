"""Prefix caching is exact: a request that starts on blocks another sequence computed (found by
their names in services/common/prefix_blocks.py) gets the logits of the same request computed
cold, within 1e-4, and the same greedy tokens; the shared blocks are never written; so with a
LoRA adapter (whose blocks are named apart from the base model's), and for a sequence preempted
and resumed on its own named blocks. On the tiny Llama and Qwen2 checkpoints, fp32, CPU."""
from __future__ import annotations

import random

import pytest
import torch

from services.common.kv_blocks import blocks_for_tokens
from services.common.prefix_blocks import PrefixCachingPool, block_hashes
from services.common.step import SamplingParams, SequenceWork, StepBatch
from tests.tiny_models import make_engine

BS = 16
HIGH, MEDIUM, LOW = 0, 1, 2
TOLERANCE = 1e-4


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 250) for _ in range(n)]


def logits(engine, seq_id, ids, start, table, lora="") -> torch.Tensor:
    """Logits of ids[start:], computed from position `start` on `table`."""
    return engine.compute_logits(StepBatch([SequenceWork(seq_id, ids[start:], start, table, lora=lora)]))[seq_id]


def greedy(engine, seq_id, ids, start, table, n, lora="") -> list[int]:
    """Prefill ids[start:] then decode until `n` tokens were sampled (greedy)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out: list[int] = []
    work = SequenceWork(seq_id, ids[start:], start, table, params, lora=lora)
    while len(out) < n:
        [sampled] = engine.step(StepBatch([work])).tokens
        out.append(sampled.token_id)
        work = SequenceWork(seq_id, [sampled.token_id], work.end, table, params, len(out), lora=lora)
    return out


def computed_and_named(engine, pool, owner, ids, n_out=0, lora="", adapter_key=""):
    """A sequence computes `ids` (and `n_out` greedy tokens) on fresh blocks, names its full
    blocks, and ends: its blocks stay cached, idle. Returns (its table, its output)."""
    table = pool.allocate(owner, blocks_for_tokens(len(ids) + n_out, BS))
    out = greedy(engine, 1, ids, 0, table, n_out, lora) if n_out else []
    if not n_out:
        logits(engine, 1, ids, 0, table, lora)
    known = ids + out[:-1] if out else ids           # the last sampled token's K/V is not computed
    for block, name in zip(table, block_hashes(known, BS, adapter_key)):
        pool.name(block, name)
    pool.free(owner, table)
    return table, out


def kv_of(engine, blocks) -> list[torch.Tensor]:
    slots = torch.tensor([b * BS + i for b in blocks for i in range(BS)])
    return [kv for layer in range(len(engine.cache.keys)) for kv in engine.cache.read(layer, slots)]


def hit_against_cold(engine, pool, ids, owner, n_out, lora="", adapter_key="") -> tuple[int, float, bool]:
    """The request on its cached prefix (shared blocks + fresh ones) against the same request
    computed cold: (tokens taken from cache, max logit difference, same greedy tokens)."""
    usable = (len(ids) - 1) // BS
    shared = pool.lookup(block_hashes(ids, BS, adapter_key)[:usable])
    pool.share(owner, shared)
    start = len(shared) * BS
    hit_table = shared + pool.allocate(owner, blocks_for_tokens(len(ids) + n_out, BS) - len(shared))
    cold_table = pool.allocate(owner, blocks_for_tokens(len(ids) + n_out, BS))
    before = kv_of(engine, shared)
    hit = logits(engine, 2, ids, start, hit_table, lora)
    cold = logits(engine, 3, ids, 0, cold_table, lora)[start:]
    same = greedy(engine, 2, ids, start, hit_table, n_out, lora) == greedy(engine, 3, ids, 0, cold_table, n_out, lora)
    assert all(torch.equal(a, b) for a, b in zip(before, kv_of(engine, shared))), "a shared block was written"
    pool.free(owner, hit_table)
    pool.free(owner, cold_table)
    return start, (hit - cold).abs().max().item(), same


def test_a_request_on_a_shared_system_prompt_matches_it_computed_cold(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64)
    pool = PrefixCachingPool(64, BS, [LOW, MEDIUM, HIGH])
    rng = random.Random(1)
    system = tokens(rng, 40)                                  # two full blocks and 8 tokens
    computed_and_named(engine, pool, HIGH, system + tokens(rng, 30))
    start, diff, same = hit_against_cold(engine, pool, system + tokens(rng, 25), LOW, n_out=12)
    assert start == 32 and diff < TOLERANCE and same


def test_a_whole_prompt_in_cache_still_computes_its_last_block(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64)
    pool = PrefixCachingPool(64, BS, [LOW, MEDIUM, HIGH])
    ids = tokens(random.Random(2), 48)                        # exactly three blocks
    computed_and_named(engine, pool, MEDIUM, ids)
    start, diff, same = hit_against_cold(engine, pool, ids, MEDIUM, n_out=8)
    assert start == 32 and diff < TOLERANCE and same          # the last token's logits are computed


def test_the_next_turn_of_a_conversation_reuses_the_previous_answer(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64)
    pool = PrefixCachingPool(64, BS, [LOW, MEDIUM, HIGH])
    rng = random.Random(3)
    turn1 = tokens(rng, 37)
    _, answer = computed_and_named(engine, pool, HIGH, turn1, n_out=30)
    turn2 = turn1 + answer + tokens(rng, 11)                 # the conversation so far, resent
    start, diff, same = hit_against_cold(engine, pool, turn2, HIGH, n_out=10)
    assert start == 64 and diff < TOLERANCE and same          # 37 + 29 computed tokens: four blocks


def test_a_preempted_sequence_resumes_on_its_own_blocks(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64)
    pool = PrefixCachingPool(64, BS, [LOW, MEDIUM, HIGH])
    prompt = tokens(random.Random(4), 50)
    table = pool.allocate(HIGH, 6)
    uninterrupted = greedy(engine, 9, prompt, 0, table, 40)
    pool.free(HIGH, table)                                    # unnamed: back to the free list
    # Preempted after 25 of its 40 tokens: its computed blocks stay named and idle ...
    _, first = computed_and_named(engine, pool, LOW, prompt, n_out=25)
    assert first == uninterrupted[:25]
    # ... and it is admitted again with all it knows (prompt + output so far), from its blocks.
    resumed = prompt + first
    start, diff, _ = hit_against_cold(engine, pool, resumed, LOW, n_out=1)
    assert start == 64 and diff < TOLERANCE
    usable = (len(resumed) - 1) // BS
    shared = pool.lookup(block_hashes(resumed, BS)[:usable])
    pool.share(LOW, shared)
    table = shared + pool.allocate(LOW, blocks_for_tokens(len(prompt) + 40, BS) - len(shared))
    rest = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    out, work = list(first), SequenceWork(5, resumed[start:], start, table, rest, len(first))
    while len(out) < 40:
        [sampled] = engine.step(StepBatch([work])).tokens
        out.append(sampled.token_id)
        work = SequenceWork(5, [sampled.token_id], work.end, table, rest, len(out))
    assert out == uninterrupted


@pytest.mark.slow
def test_with_a_lora_adapter_blocks_are_named_apart_and_exact(tiny_model_dir, tmp_path):
    from tests.engine.test_lora import ADAPTERS, make_adapter
    pytest.importorskip("peft", reason="peft is a test dependency (requirements.txt)")
    engine = make_engine(tiny_model_dir, num_blocks=64)
    engine.load_adapter("sql", make_adapter(tiny_model_dir, tmp_path / "sql", 1, **ADAPTERS["all-r8"]))
    pool = PrefixCachingPool(64, BS, [LOW, MEDIUM, HIGH])
    rng = random.Random(5)
    system = tokens(rng, 40)
    computed_and_named(engine, pool, HIGH, system + tokens(rng, 20))          # base model
    assert pool.lookup(block_hashes(system, BS, "sql#1")) == []              # not the adapter's K/V
    computed_and_named(engine, pool, HIGH, system + tokens(rng, 20), lora="sql", adapter_key="sql#1")
    start, diff, same = hit_against_cold(engine, pool, system + tokens(rng, 25), MEDIUM, n_out=10,
                                         lora="sql", adapter_key="sql#1")
    assert start == 32 and diff < TOLERANCE and same
