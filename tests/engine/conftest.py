"""Fixtures for engine tests: tiny random checkpoints and their transformers reference models.

QOS_TEST_DEVICE=cuda (or npu) runs the reference-logit tests' engine on that device, in fp32
(scripts/check_gpu.sh); the largest logit difference seen is printed at the end of the run."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from services.engine.device import set_cpu_threads
from services.engine.kernel_build import default_compiler
from tests.tiny_models import make_engine, write_tiny_model

set_cpu_threads(1)  # tests set their thread count explicitly, like every torch process here


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


TEST_DEVICE = os.environ.get("QOS_TEST_DEVICE", "cpu")
LOGIT_DIFFS: list[float] = []      # every max abs diff the reference-logit tests measured


@pytest.fixture
def tiny_engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


# On CPU both decode attention paths are checked against the reference: the paged C kernel
# (services/engine/paged_attention.py) and gather + SDPA. Elsewhere only torch's exists.
DECODE_PATHS = ["kernel", "torch"] if TEST_DEVICE == "cpu" else ["torch"]


@pytest.fixture(params=DECODE_PATHS)
def device_engine(tiny_model_dir, request):
    """The tiny engine on QOS_TEST_DEVICE (default cpu), fp32, with each decode attention path."""
    from services.engine.device import DeviceUnavailableError
    require_decode_kernel_compiler(request.param)
    try:
        return make_engine(tiny_model_dir, device=TEST_DEVICE, dtype="float32",
                           decode_attention=request.param)
    except DeviceUnavailableError as exc:
        pytest.fail(f"QOS_TEST_DEVICE={TEST_DEVICE}: {exc}")


def require_decode_kernel_compiler(decode_attention: str) -> None:
    if decode_attention == "kernel" and shutil.which(default_compiler()) is None:
        pytest.skip("the C kernels need a C compiler (cc or $CC) and this machine has none "
                    "(.ci/run installs gcc)")


def built_kernel(load, what: str):
    """A C kernel for a test (`load`: its load_* function): skipped without a compiler; with one,
    it must build."""
    require_decode_kernel_compiler("kernel")
    built = load()
    assert built is not None, f"a C compiler is present but the {what} did not build (see the log)"
    return built


class SlotKeys:
    """The paged attention kernel called with keys by slot, as a test writes them out: they are
    put in the kernel's layout (kv_cache.keys_by_block) first."""

    def __init__(self, kernel):
        self.kernel, self.path = kernel, kernel.path

    def __call__(self, q, k_cache, v_cache, tables, lens, block_size, scale):
        from services.engine.kv_cache import keys_by_block
        return self.kernel(q, keys_by_block(k_cache, block_size), v_cache, tables, lens, block_size, scale)


def pytest_sessionfinish(session):
    """Under pytest-xdist (`make test`) each process hands its comparisons to the one that prints."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["logit_diffs"] = list(LOGIT_DIFFS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    LOGIT_DIFFS.extend(getattr(node, "workeroutput", {}).get("logit_diffs", ()))


def pytest_terminal_summary(terminalreporter):
    if LOGIT_DIFFS:
        terminalreporter.write_line(
            f"reference logits on {TEST_DEVICE} (fp32): max abs diff {max(LOGIT_DIFFS):.3g} over "
            f"{len(LOGIT_DIFFS)} comparisons")
