"""Device strings, default dtypes, free memory and thread settings for the engine.

`cpu`, `cuda[:N]` and `npu[:N]` are accepted. torch_npu is imported only when an `npu` device is
asked for, guarded, because installed without the CANN stack it breaks `import torch` itself.
"""
from __future__ import annotations

import os

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
# fp32 on CPU (exact against the reference, and CPU half matmuls are slow); half on accelerators.
DEFAULT_DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16, "npu": torch.float16}


class DeviceUnavailableError(RuntimeError):
    """The requested device type is not present or its software stack is missing."""


def resolve_device(name: str) -> torch.device:
    kind = name.split(":", 1)[0]
    if kind not in DEFAULT_DTYPE:
        raise ValueError(f"unsupported device {name!r}; use cpu, cuda[:N] or npu[:N]")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(f"device {name!r} requested but CUDA is not available")
    if kind == "npu":
        _import_torch_npu()
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise DeviceUnavailableError(f"device {name!r} requested but no Ascend NPU is visible")
    return torch.device(name)


def _import_torch_npu() -> None:
    try:
        import torch_npu  # noqa: F401  (registers the npu device with torch)
    except (ImportError, OSError, RuntimeError) as exc:
        raise DeviceUnavailableError(
            f"NPU requested but the Ascend stack is missing (torch_npu / CANN): {exc}") from exc


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return DEFAULT_DTYPE[device.type]
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":
        return torch.npu.mem_get_info(device)[0]  # type: ignore[attr-defined]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


def set_cpu_threads(num_threads: int) -> int:
    """Set torch's intra-op threads explicitly (0 = every core this process may use)."""
    threads = num_threads or available_cores()
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set once in this process; torch allows that only before any parallel work
    return threads
