"""Building the engine's small C kernels (services/engine/kernels/) on first use.

A kernel is compiled with the system C compiler ($CC, else cc) into $QOS_SERVE_KERNEL_CACHE, else
kernels/ in the project's cache folder (services/common/paths.py), keyed by the source, the
flags and the machine, so a cache shared by hosts with other instruction sets never hands one a
library it cannot run. OpenMP resolves to the libgomp torch has already loaded, so kernels and
torch share one thread pool.

    path = build_library(SOURCE, flags)    # KernelBuildError (with the compiler's message) if not
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from services.common.paths import cache_root
from services.engine.device import cpu_flags

LINK_FLAGS = ["-shared", "-fopenmp"]


class KernelBuildError(RuntimeError):
    """A C kernel could not be compiled or loaded (the message says why)."""


def vector_flags(*, avx512: bool = False) -> list[str]:
    """The instruction sets this CPU has that a kernel may use: AVX2 + FMA (every x86 server of
    the last decade); with `avx512`, AVX-512 and its bf16 dot products where present."""
    flags, have = [], cpu_flags()
    if {"avx2", "fma"} <= have:
        flags += ["-mavx2", "-mfma"]
    if avx512 and {"avx512f", "avx512bw", "avx512vl"} <= have:
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl"]
        if "avx512_bf16" in have:
            flags.append("-mavx512bf16")
    return flags


def _cache_dir() -> Path:
    root = os.environ.get("QOS_SERVE_KERNEL_CACHE")
    return Path(root) if root else cache_root() / "kernels"


def build_library(source_path: Path, flags: list[str], compiler: str | None = None) -> Path:
    """Compile `source_path` with `flags` (once per source, flags and machine); returns the
    shared library."""
    compiler = compiler or os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C compiler: {compiler!r} is not on PATH (install gcc, or set CC)")
    source = source_path.read_bytes()
    key = hashlib.sha256(source + " ".join(flags + LINK_FLAGS).encode()
                         + platform.machine().encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source_path.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, built = Path(tmp) / "kernel.o", Path(tmp) / target.name
        for command in ([compiler, *flags, "-c", str(source_path), "-o", str(obj)],
                        [compiler, *LINK_FLAGS, str(obj), "-o", str(built), "-lm"]):
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise KernelBuildError(f"{compiler} failed ({result.returncode}): {result.stderr.strip()[-800:]}")
        os.replace(built, target)
    return target
