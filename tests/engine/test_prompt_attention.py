"""The paged attention kernel (services/engine/paged_attention.py) on prompt chunks, against
attention written out in torch: chunks as rows (a token each, at its own context length) over
caches whose blocks are scattered; a row's result the same bits however its chunk is cut and as a
decode; the engine's prompt_attention setting."""
from __future__ import annotations

import random

import pytest
import torch

from services.common.kv_blocks import blocks_for_tokens
from services.common.step import SequenceWork, StepBatch
from services.engine.paged_attention import load_paged_kernel
from tests.engine.conftest import SlotKeys, built_kernel, require_decode_kernel_compiler
from tests.engine.test_paged_attention import reference
from tests.tiny_models import make_engine


@pytest.fixture(scope="module")
def kernel():
    return SlotKeys(built_kernel(load_paged_kernel, "paged attention kernel"))


def chunk_rows(rng: random.Random, chunks: list[tuple[int, int]], block_size: int):
    """Rows for prompt chunks given as (cached tokens before, chunk tokens), each sequence with its
    own scattered blocks: (tables, lengths), one row per chunk token."""
    ends = [before + size for before, size in chunks]
    num_blocks = 2 * sum(blocks_for_tokens(n, block_size) for n in ends)
    free = list(range(num_blocks))
    rng.shuffle(free)
    widest = max(blocks_for_tokens(n, block_size) for n in ends)
    tables, lens = [], []
    for before, size in chunks:
        own = [free.pop() for _ in range(blocks_for_tokens(before + size, block_size))]
        own += [0] * (widest - len(own))
        for position in range(before, before + size):
            tables.append(own)
            lens.append(position + 1)
    return num_blocks, tables, lens


def random_case(seed: int, chunks, kv_heads: int, group: int, head_dim: int, block_size: int, dtype):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks, tables, lens = chunk_rows(rng, chunks, block_size)
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), kv_heads, group, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens)


@pytest.mark.parametrize("kv_heads, group, head_dim", [(1, 1, 64), (3, 3, 64), (2, 4, 128), (2, 2, 16), (1, 7, 32)])
@pytest.mark.parametrize("block_size", [16, 5, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_attention_written_out(kernel, kv_heads, group, head_dim, block_size, dtype):
    # A fresh prompt, chunks over cached context (one ending a block exactly, one a token past it),
    # a one-token chunk and one of 9 tokens over 300 (a micro-tile, a task and a value segment
    # boundary crossed), in one call.
    chunks = [(0, 37), (3 * block_size, 20), (2 * block_size - 1, 1), (300, 9), (0, 1)]
    q, k_cache, v_cache, tables, lens = random_case(kv_heads + head_dim + block_size, chunks, kv_heads,
                                                    group, head_dim, block_size, dtype)
    got = kernel(q, k_cache, v_cache, tables, lens, block_size, head_dim ** -0.5)
    assert got.dtype == dtype
    # bf16: the same values computed in fp32 and rounded once (outputs below 4 in magnitude).
    want = reference(q.float(), k_cache.float(), v_cache.float(), tables.tolist(), lens, block_size)
    assert (got.float() - want).abs().max().item() < (1e-5 if dtype == torch.float32 else 2 ** -6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, group", [(3, 3), (6, 2)])
def test_a_rows_result_does_not_depend_on_how_its_chunk_is_cut(kernel, dtype, kv_heads, group):
    """Chunked prefill, pieces between pauses, other prompts in the call, one token at a time (as
    decodes, whose values take another loop: all heads in one pass, in groups of four): the same
    bits per token."""
    q, k_cache, v_cache, tables, lens = random_case(11, [(240, 61), (0, 23)], kv_heads, group, 64, 16, dtype)
    whole = kernel(q, k_cache, v_cache, tables, lens, 16, 0.125)
    singles = list(range(85))         # every token alone: a decode of its position
    for cuts in ([0, 1, 61], [0, 13, 14, 47, 84], [0, 61, 84], [30, 84], singles):
        for start, end in zip(cuts, cuts[1:]):
            piece = kernel(q[start:end], k_cache, v_cache, tables[start:end], lens[start:end], 16, 0.125)
            assert torch.equal(piece, whole[start:end]), (cuts, start, end)


def test_kernel_refuses_shapes_it_does_not_take(kernel):
    q = torch.randn(2, 2, 3, 24)
    cache = torch.randn(64, 2, 24)
    tables, lens = torch.zeros(2, 4, dtype=torch.int64), torch.tensor([3, 4])
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel(q, cache, cache, tables, lens, 16, 0.2)
    with pytest.raises(ValueError, match="multiple of 16"):       # 17 query heads per kv head
        kernel(torch.randn(2, 1, 17, 16), torch.randn(64, 1, 16), torch.randn(64, 1, 16), tables, lens, 16, 0.25)


def prompt_logits(engine, tokens: list[int], first_chunk: int) -> torch.Tensor:
    """Logits of every position, the prompt in two chunks (the second over cached context)."""
    table = list(range(16))
    rows = [engine.compute_logits(StepBatch([SequenceWork(1, tokens[:first_chunk], 0, table)]))[1],
            engine.compute_logits(StepBatch([SequenceWork(1, tokens[first_chunk:], first_chunk, table)]))[1]]
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_prompts_on_the_kernel_agree_with_sdpa(tiny_model_dir, dtype):
    require_decode_kernel_compiler("kernel")
    on = make_engine(tiny_model_dir, num_blocks=32, dtype=dtype, prompt_attention="kernel")
    off = make_engine(tiny_model_dir, num_blocks=32, dtype=dtype, prompt_attention="torch")
    assert on.prompt_kernel is not None and on.layouter.prompts_by_kernel
    assert off.prompt_kernel is None and not off.layouter.prompts_by_kernel
    rng = random.Random(2)
    tokens = [rng.randrange(3, 512) for _ in range(90)]
    a, b = prompt_logits(on, tokens, 57), prompt_logits(off, tokens, 57)
    scale = b.abs().max().item()
    # fp32: sums in another order; bf16: each layer's output rounded to bf16 either way.
    tolerance = 1e-5 if dtype == "float32" else 0.05
    assert (a - b).abs().max().item() <= tolerance * scale


def test_engine_prompt_attention_setting(tiny_model_dir):
    from services.engine.engine import EngineConfig
    with pytest.raises(ValueError, match="prompt_attention must be one of auto, kernel, torch"):
        EngineConfig(model_dir=str(tiny_model_dir), prompt_attention="fast")
    with pytest.raises(ValueError, match="needs fp32 or bf16 on CPU"):
        make_engine(tiny_model_dir, prompt_attention="kernel", dtype="float16")
    require_decode_kernel_compiler("kernel")
    # auto, on CPU: one kernel for decodes and prompts, one arithmetic for a token either way.
    engine = make_engine(tiny_model_dir)
    assert engine.decode_kernel is engine.prompt_kernel is not None and engine.batch_invariant
    assert engine.cache.keys_transposed
    assert not make_engine(tiny_model_dir, prompt_attention="torch").batch_invariant
    off = make_engine(tiny_model_dir, prompt_attention="torch", decode_attention="torch")
    assert not off.cache.keys_transposed and off.cache.keys[0].shape == off.cache.values[0].shape


@pytest.mark.parametrize("flags", [{"avx2", "fma"}, set()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hosts_without_avx512_build_it_and_it_still_holds(kernel, monkeypatch, tmp_path, flags, dtype):
    """Built as an AVX2-only host (or one with no vector flags) would build it (its 16-wide
    vectors then split into narrower ones): it must compile, match attention written out and keep a
    row's result independent of how its chunk is cut (batch invariance there rests on it)."""
    from services.engine import kernel_build, paged_attention
    from services.engine.paged_attention import PagedKernel
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setenv("QOS_SERVE_KERNEL_CACHE", str(tmp_path))
    other = SlotKeys(PagedKernel(paged_attention.build_library()))
    assert other.path != kernel.path
    q, k_cache, v_cache, tables, lens = random_case(5, [(270, 20), (0, 9)], 3, 3, 64, 16, dtype)
    whole = other(q, k_cache, v_cache, tables, lens, 16, 0.125)
    want = reference(q.float(), k_cache.float(), v_cache.float(), tables.tolist(), lens, 16)
    assert (whole.float() - want).abs().max().item() < (1e-5 if dtype == torch.float32 else 2 ** -6)
    alone = torch.cat([other(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], lens[i:i + 1], 16, 0.125)
                       for i in range(len(lens))])
    assert torch.equal(alone, whole)
