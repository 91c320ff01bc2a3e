"""The fused layer (services/engine/decode_layer.py): taken for steps whose every token is a row of
the paged kernel (decodes, prompt chunks beside them) and only those, it computes what torch's
operations compute (bf16: the same rounding points; fp32: within the last bits of a norm's sum;
with the layer's norm and SiLU on the torch path, the same bits), a row's result depends neither
on its batch nor on whether a prompt shared its step, it pauses between layers as the torch path
does, and it stands aside where its kernels are missing."""
from __future__ import annotations

import random

import pytest
import torch

from services.common.step import SequenceWork, StepBatch
from services.engine import decode_layer, kernel_build
from tests.engine.conftest import built_kernel, require_decode_kernel_compiler
from tests.tiny_models import make_engine

VOCAB = 512


def fused_engine(model_dir, dtype: str):
    require_decode_kernel_compiler("kernel")
    engine = make_engine(model_dir, dtype=dtype)
    kernel = engine.model.layers[0].qkv.kernel
    if kernel is None or engine.dtype not in kernel.dtypes:
        pytest.skip(f"the linear kernel has no {dtype} on this CPU (bf16 needs avx512_bf16)")
    assert engine.model.fused_layers is not None
    return engine


def prefilled(engine, count: int = 5, seed: int = 0) -> StepBatch:
    """`count` sequences of different lengths prefilled; returns the step decoding one token each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(9 + 13 * i)] for i in range(count)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(count)]
    engine.compute_logits(StepBatch([SequenceWork(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))]))
    return StepBatch([SequenceWork(i, [rng.randrange(3, VOCAB)], len(p), t)
                      for i, (p, t) in enumerate(zip(prompts, tables))])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_compute_what_the_torch_path_computes(tiny_model_dir, dtype):
    engine = fused_engine(tiny_model_dir, dtype)
    decodes = prefilled(engine)
    fused = engine.compute_logits(decodes)
    fused_keys = [k.clone() for k in engine.cache.keys]
    fused_values = [v.clone() for v in engine.cache.values]
    engine.model.fused_layers = None                  # the same step again, through torch's operations
    plain = engine.compute_logits(decodes)
    # bf16: each elementwise result is rounded where torch rounds it; fp32: the norms' sums of
    # squares run in another order (last bits), which the layers carry on.
    tolerance = 1e-5 if dtype == "float32" else 2 ** -7
    for seq in fused:
        scale = plain[seq].float().abs().max().item()
        assert (fused[seq].float() - plain[seq].float()).abs().max().item() <= tolerance * scale
    for got, want in zip(fused_keys + fused_values, engine.cache.keys + engine.cache.values):
        assert (got.float() - want.float()).abs().max().item() <= tolerance * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_result_does_not_depend_on_its_batch(tiny_model_dir, dtype):
    engine = fused_engine(tiny_model_dir, dtype)
    decodes = prefilled(engine)
    batched = engine.compute_logits(decodes)
    for seq in (decodes.sequences[0], decodes.sequences[3]):
        alone = engine.compute_logits(StepBatch([seq]))      # rewrites its own slot with the same K/V
        assert torch.equal(alone[seq.seq_id], batched[seq.seq_id])


def torch_path(engine):
    """The engine with every step on torch's operations around the same kernels, norm and SiLU."""
    engine.model.fused_layers.applies = lambda *args: False
    return engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_gets_the_same_bits_with_a_prompt_in_its_step(tiny_model_dir, dtype):
    """A decode's logits do not depend on what kind of step it ran in: alone with other decodes,
    beside a prompt chunk (the fused layer too), or on the torch path that steps with adapters or
    streaming windows keep (the layer's norm and SiLU)."""
    engine = fused_engine(tiny_model_dir, dtype)
    decodes = prefilled(engine)
    alone = engine.compute_logits(decodes)
    prompt = SequenceWork(9, list(range(3, 40)), 0, list(range(40, 44)))
    mixed = engine.compute_logits(StepBatch([*decodes.sequences, prompt]))
    on_torch = torch_path(engine).compute_logits(StepBatch([*decodes.sequences, prompt]))
    for seq in decodes.sequences:
        assert torch.equal(mixed[seq.seq_id], alone[seq.seq_id])
        assert torch.equal(on_torch[seq.seq_id], alone[seq.seq_id])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_with_prompt_chunks_give_the_torch_paths_bits(tiny_model_dir, dtype):
    """Prompts from their start, decodes beside a chunk, and a chunk continuing its cached prefix:
    logits and cache alike through the fused layer and through torch's operations."""
    results = []
    for engine in (fused_engine(tiny_model_dir, dtype), torch_path(fused_engine(tiny_model_dir, dtype))):
        decodes = prefilled(engine)                        # five prompts in one step
        chunk = SequenceWork(9, list(range(3, 40)), 0, list(range(40, 44)))
        mixed = engine.compute_logits(StepBatch([*decodes.sequences, chunk]))
        rest = SequenceWork(9, list(range(50, 60)), 37, list(range(40, 44)))
        continued = engine.compute_logits(StepBatch([*decodes.sequences[:2], rest]))
        results.append((mixed, continued, [t.clone() for t in engine.cache.keys + engine.cache.values]))
    (mixed, continued, cache), (want_mixed, want_continued, want_cache) = results
    for got, want in ((mixed, want_mixed), (continued, want_continued)):
        assert got.keys() == want.keys() and all(torch.equal(got[s], want[s]) for s in got)
    assert all(torch.equal(got, want) for got, want in zip(cache, want_cache))


def test_only_steps_of_kernel_rows_without_adapters_take_it(tiny_model_dir, monkeypatch):
    engine = fused_engine(tiny_model_dir, "float32")
    decodes = prefilled(engine)
    taken = []
    run = engine.model.fused_layers.run
    engine.model.fused_layers.run = lambda *args: taken.append(True) or run(*args)
    engine.compute_logits(decodes)
    mixed = StepBatch([*decodes.sequences[:2], SequenceWork(9, list(range(3, 30)), 0, list(range(40, 44)))])
    engine.compute_logits(mixed)                      # a prompt chunk beside decodes
    assert taken == [True, True]
    _, _, layout = engine._prepare(decodes)
    assert not engine.model.fused_layers.applies(layout, object(), len(decodes.sequences), True)   # an adapter
    # With pauses, a prompt whose attention the torch path cuts into pieces (a pause after each)
    # keeps that path; the same step without pauses takes the layer.
    monkeypatch.setattr("services.engine.model.ATTENTION_PIECE_SCORES", 64)
    mixed = StepBatch([*decodes.sequences[:2], SequenceWork(10, list(range(3, 30)), 0, list(range(44, 48)))])
    _, token_ids, layout = engine._prepare(mixed)
    pauses = []
    engine.model.forward(token_ids, layout, engine.cache, pause=lambda: pauses.append(1))
    assert taken == [True, True] and len(pauses) > len(engine.model.layers) - 1
    engine.model.forward(token_ids, layout, engine.cache)
    assert taken == [True, True, True]


def test_it_pauses_between_layers(tiny_model_dir):
    engine = fused_engine(tiny_model_dir, "float32")
    decodes = prefilled(engine)
    fused, plain = [], []
    engine.compute_logits(decodes)
    engine.model.forward(*engine._prepare(decodes)[1:], engine.cache, pause=lambda: fused.append(1))
    engine.model.fused_layers = None
    engine.model.forward(*engine._prepare(decodes)[1:], engine.cache, pause=lambda: plain.append(1))
    assert len(fused) == len(plain) == len(engine.model.layers) - 1


def test_missing_kernels_leave_the_torch_path(tiny_model_dir, monkeypatch):
    require_decode_kernel_compiler("kernel")
    assert make_engine(tiny_model_dir, decode_attention="torch").model.fused_layers is None
    monkeypatch.setattr("services.engine.linear.load_linear_kernel", lambda: None)
    assert make_engine(tiny_model_dir).model.fused_layers is None          # oneDNN's linear layers


@pytest.mark.parametrize("flags", [{"avx2", "fma"}, set()])
def test_other_hosts_builds_give_the_same_norm_and_silu_bits(monkeypatch, tmp_path, flags):
    """Built as an AVX2-only host (or one with no vector flags) would build it: no fast-math and
    no contraction, so the norm's fixed-order sums and the elementwise steps give this host's bits
    whatever the vector width."""
    here = built_kernel(decode_layer.load_decode_layer_kernel, "fused layer")
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setenv("QOS_SERVE_KERNEL_CACHE", str(tmp_path))
    other = decode_layer.DecodeLayerKernel(decode_layer.build())
    assert other.path != here.path
    generator = torch.Generator().manual_seed(3)
    for bf16, dtype in ((0, torch.float32), (1, torch.bfloat16)):
        x = torch.randn(37, 576, generator=generator).to(dtype)
        weight = torch.randn(576, generator=generator).to(dtype)
        gate_up = (torch.randn(37, 3072, generator=generator) * 4).to(dtype)
        results = []
        for kernel in (here, other):
            normed, mixed = torch.empty_like(x), torch.empty(37, 1536, dtype=dtype)
            kernel.rms_norm_rows(x.data_ptr(), weight.data_ptr(), normed.data_ptr(), 37, 576, 1e-5, 2, bf16)
            kernel.silu_mul_rows(gate_up.data_ptr(), mixed.data_ptr(), 37, 1536, 2, bf16)
            results.append((normed, mixed))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_torchs_within_two_ulps(dtype):
    """silu(gate) * up against torch's (silu in fp32, rounded to the model dtype, then the product),
    over a width the bf16 path's pieces do not divide, with infinities and a NaN: within two units
    in the last place (the exponential's one, carried by the product)."""
    kernel = built_kernel(decode_layer.load_decode_layer_kernel, "fused layer")
    generator = torch.Generator().manual_seed(11)
    rows, n = 9, 600
    gate_up = (torch.randn(rows, 2 * n, generator=generator) * 8).to(dtype)
    gate_up[0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0])
    out = torch.empty(rows, n, dtype=dtype)
    kernel.silu_mul_rows(gate_up.data_ptr(), out.data_ptr(), rows, n, 2, int(dtype == torch.bfloat16))
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype)
    assert torch.equal(out.isnan(), want.isnan())
    ulp = 2 * torch.finfo(dtype).eps * want.float().abs().clamp(min=torch.finfo(dtype).tiny)
    close = ((out.float() - want.float()).abs() <= ulp) | want.isnan() | (out.float() == want.float())
    assert bool(close.all())
