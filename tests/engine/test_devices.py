"""Device backends (services/engine/device.py): the CPU one here; CUDA and NPU where present (they
skip with the reason otherwise; scripts/check_gpu.sh runs them on a GPU machine); and the NPU
worker's guard against a torch_npu without CANN, shown in a throwaway venv with the real wheel."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from services.common.step import SequenceWork, StepBatch
from services.engine.device import (CpuBackend, DeviceUnavailableError, cpu_has_native_bf16, open_backend,
                                    parse_device)
from tests.tiny_models import make_engine, reference_logits

ROOT = Path(__file__).resolve().parents[2]
NPU_WHEEL_DIR = Path(os.environ.get("QOS_SERVE_NPU_WHEEL_DIR", Path(sys.prefix) / "wheels"))


def test_cpu_backend_reports_what_the_engine_needs():
    cpu = open_backend("cpu")
    assert isinstance(cpu, CpuBackend) and cpu.device == torch.device("cpu")
    assert cpu.preferred_dtype == (torch.bfloat16 if cpu_has_native_bf16(cpu.flags) else torch.float32)
    assert cpu.dtype_reason
    memory = cpu.memory()
    assert 0 < memory.free_bytes <= memory.total_bytes
    assert cpu.name and cpu.utilization() is None
    cpu.synchronize()


@pytest.mark.parametrize("name, parsed", [("cpu", ("cpu", None)), ("cuda", ("cuda", None)),
                                          ("cuda:3", ("cuda", 3)), ("npu:1", ("npu", 1))])
def test_device_names_parse(name, parsed):
    assert parse_device(name) == parsed


@pytest.mark.parametrize("name", ["tpu", "cpu:1", "cuda:x", "npu:", "CUDA"])
def test_bad_device_names_are_refused(name):
    with pytest.raises(ValueError, match="unsupported device"):
        parse_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_missing_cuda_names_the_cause():
    with pytest.raises(DeviceUnavailableError, match="CUDA is not available: torch .* CPU-only build"):
        open_backend("cuda:0")


def run_cli(python: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    return subprocess.run([python, "-m", "services.tools.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("device, missing", [("npu", "torch_npu is not installed"),
                                             ("cuda", "CUDA is not available")])
def test_worker_without_the_device_stack_exits_with_the_reason(device, missing):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = run_cli(sys.executable, "worker", "--device", device)
    assert result.returncode == 3, result.stderr
    assert missing in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_torch_npu_without_cann_breaks_plain_import_torch_but_not_our_services(tmp_path):
    """A throwaway venv that sees this venv's packages plus the real torch_npu wheel, without
    CANN. Plain `import torch` fails there (torch auto-loads torch_npu), which is why torch_npu is
    never a default dependency; our entry points import torch fine and the NPU worker exits with
    a message naming what is missing."""
    wheels = sorted(NPU_WHEEL_DIR.glob("torch_npu-*.whl"))
    if not wheels:
        pytest.skip(f"no torch_npu wheel in {NPU_WHEEL_DIR} (`make test` downloads it)")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # The throwaway venv sees this one's packages (torch, grpc...) after its own.
    Path(site, "parent_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--target", site, str(wheels[-1])], check=True, capture_output=True)

    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    plain = subprocess.run([python, "-c", "import torch"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert plain.returncode != 0 and "torch_npu" in plain.stderr, plain.stderr[-2000:]

    ours = subprocess.run([python, "-c", "import services.tools.cli, torch; print(torch.ones(3).sum().item())"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert ours.returncode == 0 and ours.stdout.strip() == "3.0", ours.stderr[-2000:]

    worker = run_cli(python, "worker", "--device", "npu")
    assert worker.returncode == 3, worker.stderr[-2000:]
    assert "torch_npu is installed but the CANN toolkit is not usable" in worker.stderr
    assert "Traceback" not in worker.stderr


# --- accelerators: run where present, skipped with the reason here --------------------------

def accelerator(kind: str):
    try:
        return open_backend(kind)
    except DeviceUnavailableError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_accelerator_backend(kind):
    backend = accelerator(kind)
    assert backend.device.type == kind
    assert backend.preferred_dtype in (torch.bfloat16, torch.float16)
    memory = backend.memory()
    assert 0 < memory.free_bytes <= memory.total_bytes
    utilization = backend.utilization()
    assert utilization is None or 0.0 <= utilization <= 1.0
    assert backend.name
    backend.synchronize()


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_accelerator_kv_cache_is_sized_from_free_device_memory(kind, tiny_model_dir):
    from services.engine.engine import Engine, EngineConfig
    backend = accelerator(kind)
    free = backend.memory().free_bytes
    engine = Engine(EngineConfig(model_dir=str(tiny_model_dir), device=kind, kv_cache_fraction=0.01,
                                 num_threads=1), backend)
    assert engine.cache.keys[0].device.type == kind
    # 1% of what was free once the weights were loaded (at most what was free before).
    assert 0 < engine.kv_spec.total_bytes <= 0.01 * free


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_accelerator_half_precision_logits_track_the_fp32_reference(kind, tiny_model_dir, tiny_reference):
    backend = accelerator(kind)
    engine = make_engine(tiny_model_dir, device=kind, dtype=None)   # the device's own dtype
    tokens = [random.Random(3).randrange(3, 512) for _ in range(64)]
    got = engine.compute_logits(StepBatch([SequenceWork(1, tokens, 0, list(range(4)))]))[1]
    assert engine.dtype == backend.preferred_dtype     # the logits themselves come back in fp32
    want = reference_logits(tiny_reference, tokens)
    relative = ((got.float().cpu() - want).abs().max() / want.abs().max()).item()
    assert relative < 0.05, f"{backend.preferred_dtype}: max diff {relative:.3g} of the largest logit"
