"""bench/decode_compile.py compares like with like: each compiled chain computes what the eager
one does (within a rounding of the dtype), so its per-call times are the compile's cost alone."""
from __future__ import annotations

import pytest
import torch

from bench.decode_compile import chains

pytestmark = pytest.mark.slow          # inductor compiles three graphs per dtype (~10 s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_compiled_chain_computes_the_eager_one(dtype):
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    with torch.inference_mode():
        for name, (fn, inputs) in chains(dtype).items():
            eager, compiled = fn(*inputs), torch.compile(fn, dynamic=False)(*inputs)
            for want, got in zip(eager if isinstance(eager, tuple) else (eager,),
                                 compiled if isinstance(compiled, tuple) else (compiled,)):
                assert got.dtype == want.dtype and got.shape == want.shape, name
                assert torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance), name
