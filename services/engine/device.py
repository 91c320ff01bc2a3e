"""Device backends: what the engine and the worker need to know about the hardware they run on.

    backend = open_backend("cuda:1")      # or "cpu", "npu:0"; DeviceUnavailableError if absent
    backend.device, backend.preferred_dtype, backend.memory(), backend.utilization()

One small interface, three implementations:
- CPU: bf16 where the CPU multiplies bf16 natively (the avx512_bf16 or amx_bf16 flag: Cooper
  Lake, Sapphire Rapids and later, Zen 4 and later), else fp32: without those instructions torch
  emulates bf16 matmuls: on our 2-core Zen 3 the engine ran 5x slower in bf16 than in fp32 at
  batch 32 (bench/engine_throughput.py). Memory from /proc/meminfo, no utilization of its own
  (the worker measures its busy time).
- CUDA: bf16 where the GPU supports it (fp16 otherwise), memory from `torch.cuda.mem_get_info`,
  utilization from NVML (`nvidia-ml-py`, optional) when it is installed.
- NPU (Ascend): torch_npu is imported only here, guarded, because installed without the CANN
  stack it breaks `import torch` itself; entry points set TORCH_DEVICE_BACKEND_AUTOLOAD=0 before
  torch is imported so that torch never loads it on its own (services/tools/cli.py). bf16 where
  supported (Ascend 910B), else fp16; memory from `torch.npu.mem_get_info`.
A backend that is asked for but absent raises DeviceUnavailableError naming what is missing.
"""
from __future__ import annotations

import logging
import os
import platform
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
# /proc/cpuinfo flags of x86 CPUs that multiply bf16 in hardware (AVX512-BF16 dot products, AMX tiles).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


class DeviceUnavailableError(RuntimeError):
    """The requested device type is not present or its software stack is missing."""


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    free_bytes: int
    total_bytes: int


class DeviceBackend(ABC):
    """One kind of device: which torch device, its preferred dtype, memory, utilization."""
    kind: str

    def __init__(self, device: torch.device):
        self.device = device

    @property
    @abstractmethod
    def preferred_dtype(self) -> torch.dtype: ...

    @property
    def dtype_reason(self) -> str:
        """Why preferred_dtype is what it is, for the engine's log."""
        if self.preferred_dtype == torch.bfloat16:
            return f"{self.name} supports bf16"
        return f"{self.name} has no bf16 support"

    @property
    @abstractmethod
    def name(self) -> str:
        """What the hardware is, for logs and Info."""

    @abstractmethod
    def memory(self) -> MemoryInfo: ...

    def utilization(self) -> float | None:
        """The device's own busy share (0..1), or None when the hardware does not report one."""
        return None

    def synchronize(self) -> None:
        """Wait for queued device work (timings are only honest after this)."""


class CpuBackend(DeviceBackend):
    kind = "cpu"

    def __init__(self, index: int | None = None):
        super().__init__(torch.device("cpu"))
        self.flags = cpu_flags()

    @property
    def preferred_dtype(self) -> torch.dtype:
        return torch.bfloat16 if cpu_has_native_bf16(self.flags) else torch.float32

    @property
    def dtype_reason(self) -> str:
        native = sorted(NATIVE_BF16_FLAGS & self.flags)
        if native:
            return f"the CPU multiplies bf16 natively ({', '.join(native)})"
        return ("the CPU has no native bf16 matmul (no avx512_bf16 or amx_bf16 flag): "
                "bf16 would be emulated, several times slower than fp32")

    @property
    def name(self) -> str:
        for line in read_lines("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
        return platform.machine() or "unknown CPU"

    def memory(self) -> MemoryInfo:
        fields = {}
        for line in read_lines("/proc/meminfo"):
            key, _, rest = line.partition(":")
            if key in ("MemAvailable", "MemTotal"):
                fields[key] = int(rest.split()[0]) * 1024
        if len(fields) == 2:
            return MemoryInfo(fields["MemAvailable"], fields["MemTotal"])
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page)


class CudaBackend(DeviceBackend):
    kind = "cuda"

    def __init__(self, index: int | None = None):
        requested = f"cuda:{index or 0}"
        if not torch.cuda.is_available():
            built = torch.version.cuda
            why = (f"torch {torch.__version__} is a CPU-only build" if built is None
                   else f"torch {torch.__version__} (CUDA {built}) sees no GPU or driver")
            raise DeviceUnavailableError(f"device {requested!r} requested but CUDA is not available: {why}")
        count = torch.cuda.device_count()
        if (index or 0) >= count:
            raise DeviceUnavailableError(f"device {requested!r} requested but only {count} CUDA "
                                         "device(s) are visible")
        super().__init__(torch.device("cuda", index or 0))
        torch.cuda.set_device(self.device)
        self._nvml = _nvml_handle(index or 0)

    @property
    def preferred_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    @property
    def name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def memory(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryInfo(free, total)

    def utilization(self) -> float | None:
        if self._nvml is None:
            return None
        import pynvml
        return pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu / 100.0

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class NpuBackend(DeviceBackend):
    kind = "npu"

    def __init__(self, index: int | None = None):
        requested = f"npu:{index or 0}"
        _import_torch_npu()
        npu = torch.npu  # type: ignore[attr-defined]  (registered by torch_npu)
        if not npu.is_available():
            raise DeviceUnavailableError(f"device {requested!r} requested but no Ascend NPU is "
                                         "visible (torch_npu and CANN load, but no /dev/davinci* "
                                         "device: check the driver and the container's device mounts)")
        count = npu.device_count()
        if (index or 0) >= count:
            raise DeviceUnavailableError(f"device {requested!r} requested but only {count} NPU(s) are visible")
        super().__init__(torch.device("npu", index or 0))
        npu.set_device(self.device)

    @property
    def preferred_dtype(self) -> torch.dtype:
        supported = getattr(torch.npu, "is_bf16_supported", None)  # type: ignore[attr-defined]
        return torch.bfloat16 if supported is not None and supported() else torch.float16

    @property
    def name(self) -> str:
        return torch.npu.get_device_name(self.device)  # type: ignore[attr-defined]

    def memory(self) -> MemoryInfo:
        free, total = torch.npu.mem_get_info(self.device)  # type: ignore[attr-defined]
        return MemoryInfo(free, total)

    def utilization(self) -> float | None:
        read = getattr(torch.npu, "utilization", None)  # type: ignore[attr-defined]
        try:
            return read(self.device) / 100.0 if read is not None else None
        except RuntimeError:       # older drivers do not report it
            return None

    def synchronize(self) -> None:
        torch.npu.synchronize(self.device)  # type: ignore[attr-defined]


BACKENDS: dict[str, type[DeviceBackend]] = {"cpu": CpuBackend, "cuda": CudaBackend, "npu": NpuBackend}


def parse_device(name: str) -> tuple[str, int | None]:
    """("cuda", 1) for "cuda:1". Parsed by hand: torch cannot parse "npu" before torch_npu loads."""
    kind, colon, index = name.partition(":")
    if kind not in BACKENDS or (colon and not index.isdigit()) or (kind == "cpu" and colon):
        raise ValueError(f"unsupported device {name!r}; use cpu, cuda[:N] or npu[:N]")
    return kind, int(index) if colon else None


def open_backend(name: str) -> DeviceBackend:
    """The backend for `cpu`, `cuda[:N]` or `npu[:N]`; DeviceUnavailableError when it is absent."""
    kind, index = parse_device(name)
    return BACKENDS[kind](index)


def resolve_device(name: str) -> torch.device:
    return open_backend(name).device


def resolve_dtype(name: str | None, backend: DeviceBackend) -> torch.dtype:
    if name is None:
        return backend.preferred_dtype
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def dtype_reason(name: str | None, backend: DeviceBackend) -> str:
    """Why resolve_dtype(name, backend) picks what it picks: the config, or the hardware."""
    return f"dtype = {name!r} in the config" if name is not None else backend.dtype_reason


def cpu_has_native_bf16(flags: Iterable[str]) -> bool:
    """Whether a CPU with these /proc/cpuinfo flags multiplies bf16 in hardware."""
    return not NATIVE_BF16_FLAGS.isdisjoint(flags)


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (x86 Linux); none elsewhere."""
    for line in read_lines("/proc/cpuinfo"):
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _import_torch_npu() -> None:
    try:
        import torch_npu  # noqa: F401  (registers the npu device with torch)
    except ModuleNotFoundError as exc:
        if exc.name != "torch_npu":
            raise DeviceUnavailableError(f"NPU requested but the Ascend stack is missing: torch_npu "
                                         f"needs {exc.name!r}: {exc}") from exc
        raise DeviceUnavailableError(
            "NPU requested but the Ascend stack is missing: torch_npu is not installed "
            "(install qos-serve[npu] on a machine with the CANN toolkit)") from exc
    except (ImportError, OSError, RuntimeError) as exc:
        raise DeviceUnavailableError(
            f"NPU requested but the Ascend stack is missing: torch_npu is installed but the CANN "
            f"toolkit is not usable ({_cann_hint()}): {exc}") from exc


def _cann_hint() -> str:
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    if home:
        return f"ASCEND_HOME_PATH={home}"
    if os.path.isdir("/usr/local/Ascend/ascend-toolkit"):
        return "/usr/local/Ascend/ascend-toolkit exists but its set_env.sh was not sourced"
    return "no CANN toolkit: ASCEND_HOME_PATH is unset and /usr/local/Ascend/ascend-toolkit is absent"


def _nvml_handle(index: int):
    """NVML's handle for the CUDA device `index` (matched by UUID, so CUDA_VISIBLE_DEVICES
    renumbering is handled), or None without nvidia-ml-py."""
    try:
        import pynvml
    except ImportError:
        log.info("nvidia-ml-py not installed: the GPU worker reports no hardware utilization")
        return None
    try:
        pynvml.nvmlInit()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:
            return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError as exc:
        log.warning("NVML unavailable (%s): no hardware utilization", exc)
        return None


def read_lines(path: str) -> list[str]:
    """A /proc file's lines, or none where it cannot be read (not Linux, a sandbox)."""
    try:
        with open(path) as f:
            return f.readlines()
    except OSError:
        return []


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
