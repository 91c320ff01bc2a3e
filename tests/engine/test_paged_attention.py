"""The paged attention kernel (services/engine/paged_attention.py) against attention written out in
torch, for decodes, on caches whose blocks are scattered, for the shapes Llama-family models use;
its argument checks, its build, the engine's decode_attention setting and the cache's key layout.
Prompt chunks: test_prompt_attention.py."""
from __future__ import annotations

import random

import pytest
import torch

from services.common.kv_blocks import blocks_for_tokens
from services.engine import paged_attention
from services.engine.paged_attention import KernelBuildError, build_library, load_paged_kernel
from tests.engine.conftest import SlotKeys, built_kernel, require_decode_kernel_compiler


@pytest.fixture(scope="module")
def raw_kernel():
    return built_kernel(load_paged_kernel, "paged attention kernel")


@pytest.fixture(scope="module")
def kernel(raw_kernel):
    return SlotKeys(raw_kernel)


def reference(q, k_cache, v_cache, tables, lens, block_size):
    """Each sequence's keys and values gathered token by token, then softmax(q k^T / sqrt(d)) v."""
    out = torch.empty_like(q)
    kv_heads, group, head_dim = q.shape[1:]
    for s, length in enumerate(lens.tolist()):
        slots = [tables[s][t // block_size] * block_size + t % block_size for t in range(length)]
        keys, values = k_cache[slots], v_cache[slots]                # [len, kv_heads, head_dim]
        for h in range(kv_heads):
            scores = q[s, h] @ keys[:, h].T / head_dim ** 0.5          # [group, len]
            out[s, h] = torch.softmax(scores, dim=-1) @ values[:, h]
    return out


@pytest.mark.parametrize("kv_heads, group, head_dim", [(1, 1, 64), (3, 3, 64), (2, 4, 128), (4, 2, 32), (6, 2, 32)])
@pytest.mark.parametrize("block_size", [16, 5, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_attention_written_out(kernel, kv_heads, group, head_dim, block_size, dtype):
    rng = random.Random(kv_heads * 100 + head_dim + block_size)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    # One token, a block exactly, a block and one, and longer contexts of any length.
    lens = [1, block_size, block_size + 1, 2 * block_size - 1] + [rng.randrange(1, 300) for _ in range(6)]
    num_blocks = 2 * sum(blocks_for_tokens(n, block_size) for n in lens)   # half of the cache unused
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)
    widest = max(blocks_for_tokens(n, block_size) for n in lens)
    tables = []
    for n in lens:
        own = [free.pop() for _ in range(blocks_for_tokens(n, block_size))]
        tables.append(own + [0] * (widest - len(own)))
    q = torch.randn(len(lens), kv_heads, group, head_dim, generator=gen)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    tables_t, lens_t = torch.tensor(tables), torch.tensor(lens)
    got = kernel(q, k_cache, v_cache, tables_t, lens_t, block_size, head_dim ** -0.5)
    assert got.dtype == dtype
    # bf16: the same values computed in fp32 and rounded once (outputs are below 4 in magnitude,
    # where a bf16 ulp is at most 2^-6).
    want = reference(q.float(), k_cache.float(), v_cache.float(), tables, lens_t, block_size)
    assert (got.float() - want).abs().max().item() < (1e-5 if dtype == torch.float32 else 2 ** -6)


def test_kernel_refuses_what_it_cannot_compute(raw_kernel):
    q = torch.randn(2, 3, 3, 64)
    keys, values = torch.randn(4, 3, 64, 16), torch.randn(64, 3, 64)
    tables, lens = torch.zeros(2, 4, dtype=torch.int64), torch.tensor([3, 5])
    with pytest.raises(TypeError, match="fp32 or bf16"):
        raw_kernel(q.double(), keys.double(), values.double(), tables, lens, 16, 0.125)
    with pytest.raises(TypeError, match="one dtype"):
        raw_kernel(q.bfloat16(), keys, values, tables, lens, 16, 0.125)
    with pytest.raises(TypeError, match="int64"):
        raw_kernel(q, keys, values, tables.int(), lens, 16, 0.125)
    with pytest.raises(ValueError, match="cache shapes"):             # keys by slot, not by block
        raw_kernel(q, values, values, tables, lens, 16, 0.125)
    with pytest.raises(ValueError, match="cache shapes"):             # another block size
        raw_kernel(q, keys, values, tables, lens, 8, 0.125)
    with pytest.raises(ValueError, match="one block table row"):
        raw_kernel(q, keys, values, tables[:1], lens, 16, 0.125)


def test_a_missing_compiler_is_a_clear_build_error(tmp_path, monkeypatch):
    monkeypatch.setenv("QOS_SERVE_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(KernelBuildError, match="no C compiler: 'no-such-cc'"):
        build_library(compiler="no-such-cc")


def test_a_compiler_error_is_reported_with_its_message(tmp_path, monkeypatch):
    require_decode_kernel_compiler("kernel")
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(paged_attention, "SOURCE", broken)
    monkeypatch.setenv("QOS_SERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KernelBuildError, match="failed"):
        build_library()
    assert not list((tmp_path / "cache").glob("*.so")), "a failed build must leave no library behind"


def test_engine_decode_attention_setting(tiny_model_dir):
    from services.engine.engine import EngineConfig
    from tests.tiny_models import make_engine
    with pytest.raises(ValueError, match="decode_attention must be one of auto, kernel, torch"):
        EngineConfig(model_dir=str(tiny_model_dir), decode_attention="fast")
    assert make_engine(tiny_model_dir, decode_attention="torch").decode_kernel is None
    require_decode_kernel_compiler("kernel")
    assert make_engine(tiny_model_dir, decode_attention="auto").decode_kernel is not None
    assert make_engine(tiny_model_dir, decode_attention="auto", dtype="bfloat16").decode_kernel is not None
    with pytest.raises(ValueError, match="needs fp32 or bf16 on CPU"):
        make_engine(tiny_model_dir, decode_attention="kernel", dtype="float16")


@pytest.mark.parametrize("keys_transposed", [True, False])
def test_the_cache_reads_back_what_it_wrote_in_either_layout(keys_transposed):
    """Keys by block (the kernel's layout) or by slot: write, read and whole-block gathers agree."""
    from types import SimpleNamespace
    from services.engine.kv_cache import KVCacheSpec, PagedKVCache, keys_by_block
    config = SimpleNamespace(num_kv_heads=2, head_dim=16, num_layers=1)
    cache = PagedKVCache(config, KVCacheSpec(6, 5, 0), torch.device("cpu"), torch.float32, keys_transposed)
    slots = torch.tensor([7, 0, 29, 12, 13, 14])
    keys, values = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    cache.write(0, slots, keys, values)
    got_keys, got_values = cache.read(0, slots)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    by_slot = torch.zeros(30, 2, 16)
    by_slot[slots] = keys
    assert torch.equal(cache.keys[0], keys_by_block(by_slot, 5) if keys_transposed else by_slot)
    key_rows, value_rows = cache.new_gather_buffers(2)
    cache.gather_blocks(0, torch.tensor([5, 1]), key_rows, value_rows)
    assert torch.equal(key_rows.view(2, 5, 2, 16), by_slot.view(6, 5, 2, 16)[[5, 1]])


def test_loading_the_kernel_leaves_the_processs_float_environment_alone(kernel):
    """Linked with -ffast-math, the library would switch on flush-to-zero for every float op of
    the process (gcc's crtfastmath.o constructor), torch's included: a denormal must survive."""
    denormal = torch.tensor([1e-39], dtype=torch.float32)
    assert (denormal * 1.0).item() != 0.0
