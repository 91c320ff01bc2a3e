"""The linear-layer C kernel (services/engine/linear_kernel.py) against matmuls in float64, for
the shapes models use and the awkward ones (an output count that is not a multiple of the
32-row tile, one row, rows beyond a tile's 8), and the batch-invariance it promises."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine import kernel_build, linear_kernel
from services.engine import linear as linear_module
from services.engine.linear import Linear
from services.engine.linear_kernel import LinearKernel, load_linear_kernel, place_on_huge_pages
from services.engine.kernel_build import vector_flags
from tests.engine.conftest import built_kernel

ROWS = [1, 2, 7, 8, 9, 17, 33]


@pytest.fixture(scope="module")
def kernel():
    return built_kernel(load_linear_kernel, "linear kernel")


def dtypes(kernel):
    return sorted(kernel.dtypes, key=str)


def test_bf16_is_built_exactly_where_the_cpu_has_its_dot_product(kernel):
    assert (torch.bfloat16 in kernel.dtypes) == ("-mavx512bf16" in vector_flags(avx512=True))
    assert torch.float32 in kernel.dtypes


@pytest.mark.parametrize("out_features, in_features", [(960, 576), (576, 1536), (100, 64), (7, 6), (33, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_is_as_close_to_float64_as_torch(kernel, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(out_features * 7 + in_features)
    for dtype in dtypes(kernel):
        weight = (torch.randn(out_features, in_features, generator=generator) * 0.1).to(dtype)
        bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
        layer = Linear(weight, bias)
        assert layer.backend == "kernel"
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=generator).to(dtype)
            exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
            got = layer(x)
            assert got.dtype == dtype and got.shape == (rows, out_features)
            torch_error = (F.linear(x, weight, bias).double() - exact).abs().max().item()
            error = (got.double() - exact).abs().max().item()
            # fp32: one running sum per output over K (torch sums in blocks: a few times closer);
            # bf16: the same fp32 sums, one rounding of the output.
            bound = 8 * torch_error + 1e-6 if dtype == torch.float32 else 1.01 * torch_error + 1e-6
            assert error <= bound, (dtype, rows, error, torch_error)


def test_a_rows_result_does_not_depend_on_its_batch(kernel):
    generator = torch.Generator().manual_seed(3)
    for dtype in dtypes(kernel):
        layer = Linear((torch.randn(200, 96, generator=generator) * 0.1).to(dtype))
        batch = torch.randn(40, 96, generator=generator).to(dtype)
        together = layer(batch)
        for row in (0, 7, 8, 39):
            assert torch.equal(layer(batch[row:row + 1]), together[row:row + 1])
            assert torch.equal(layer(batch[row:]), together[row:])


def test_kernel_refuses_what_it_cannot_compute(kernel):
    layer = Linear(torch.randn(64, 32))
    with pytest.raises(TypeError, match="2-D CPU input of torch.float32"):
        layer(torch.randn(2, 32).double())
    with pytest.raises(TypeError, match="2-D CPU input"):
        layer(torch.randn(2, 2, 32))
    with pytest.raises(ValueError, match="input has 31 features, the weight 32"):
        layer(torch.randn(2, 31))


def test_an_odd_bf16_width_and_a_missing_kernel_keep_the_other_paths(kernel, monkeypatch):
    if torch.bfloat16 in kernel.dtypes:
        assert Linear(torch.randn(16, 7).bfloat16()).backend != "kernel"
    assert Linear(torch.randn(16, 8), prepack=False).backend == "torch"
    monkeypatch.setattr(linear_module, "load_linear_kernel", lambda: None)
    weight, x = torch.randn(16, 8), torch.randn(3, 8)
    fallback = Linear(weight.clone())
    assert fallback.backend in ("onednn", "torch")
    assert torch.allclose(fallback(x), F.linear(x, weight), atol=1e-5)


def test_weights_moved_to_one_buffer_give_the_same_results(kernel):
    generator = torch.Generator().manual_seed(5)
    layers = [Linear((torch.randn(n, 64, generator=generator) * 0.1)) for n in (96, 40, 200)]
    x = torch.randn(3, 64, generator=generator)
    before = [layer(x) for layer in layers]
    moved = place_on_huge_pages(layers + [Linear(torch.randn(8, 64), prepack=False)])
    assert moved >= sum(layer.packed.numel() * 4 for layer in layers)
    # one buffer, in order, each weight right after the one before
    for first, second in zip(layers, layers[1:]):
        assert second.packed.data_ptr() == first.packed.data_ptr() + first.packed.numel() * 4
    assert all(torch.equal(layer(x), want) for layer, want in zip(layers, before))


@pytest.mark.parametrize("flags, same_bits", [({"avx2", "fma"}, True), (set(), False)])
def test_hosts_without_avx512_build_the_fp32_kernel(kernel, monkeypatch, tmp_path, flags, same_bits):
    """Built as an AVX2-only host (or one with no vector flags) would build it: fp32 only, as
    close to float64 as torch; with FMA each output's sum is the same sequence of fused steps
    whatever the vector width, so its bits equal this host's build."""
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setenv("QOS_SERVE_KERNEL_CACHE", str(tmp_path))
    other = LinearKernel(linear_kernel.build())
    assert other.dtypes == {torch.float32} and other.path != kernel.path
    generator = torch.Generator().manual_seed(11)
    weight, x = torch.randn(100, 576, generator=generator) * 0.1, torch.randn(9, 576, generator=generator)
    got = other(x, other.pack(weight), None, 100)
    exact = x.double() @ weight.double().T
    torch_error = (F.linear(x, weight).double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 8 * torch_error + 1e-6
    if same_bits:
        assert torch.equal(got, kernel(x, kernel.pack(weight), None, 100))


def test_layers_packed_later_go_straight_into_the_buffer(kernel):
    """The model's path: no packed copy until the buffer exists, then each packed into its place;
    the results equal layers packed at once."""
    generator = torch.Generator().manual_seed(6)
    for dtype in dtypes(kernel):
        weights = [(torch.randn(n, 64, generator=generator) * 0.1).to(dtype) for n in (96, 40, 200)]
        x = torch.randn(5, 64, generator=generator).to(dtype)
        later = [Linear(w.clone(), pack_later=True) for w in weights]
        assert all(layer.packed is None and layer.backend == "kernel" for layer in later)
        place_on_huge_pages(later)
        for first, second in zip(later, later[1:]):
            end = first.packed.data_ptr() + first.packed.numel() * first.packed.element_size()
            assert second.packed.data_ptr() == end
        assert all(layer.weight is None for layer in later)
        assert all(torch.equal(layer(x), Linear(w)(x)) for layer, w in zip(later, weights))
