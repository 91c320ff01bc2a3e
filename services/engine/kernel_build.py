"""Building the engine's small C kernels (services/engine/kernels/) on first use.

A kernel is compiled with the system C compiler ($CC, else cc) into $QOS_SERVE_KERNEL_CACHE, else
kernels/ in the project's cache folder (services/common/paths.py), keyed by the source, the
flags and the machine, so a cache shared by hosts with other instruction sets never hands one a
library it cannot run. OpenMP resolves to the libgomp torch has already loaded, so kernels and
torch share one thread pool.

    path = build_library(SOURCE, flags)    # KernelBuildError (with the compiler's message) if not
    kernel = load_once("linear layers", lambda: Kernel(build_library(...)), "oneDNN")
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, TypeVar

from services.common.paths import cache_root
from services.engine.device import cpu_flags

log = logging.getLogger(__name__)

LINK_FLAGS = ["-shared", "-fopenmp"]
# A kernel whose vectors are wider than the flags' registers still compiles, into code that keeps
# each vector in memory: built for AVX2 with 16-wide vectors, the linear kernel ran at 3 GFLOPS
# (56-110 for F.linear) and the engine decoded at a twentieth of its speed. GCC says so
# (-Wvector-operation-performance, -Wpsabi); as errors, such a build fails and the engine keeps
# the torch path, logged. Other compilers ignore the options they lack.
GUARD_FLAGS = ["-Werror=vector-operation-performance", "-Werror=psabi"]

Kernel = TypeVar("Kernel")
_lock = threading.Lock()
_loaded: dict[str, object] = {}      # what the kernel does -> the kernel, or None once it failed


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


def default_compiler() -> str:
    """The C compiler the kernels are built with: $CC, else cc."""
    return os.environ.get("CC") or "cc"


def build_library(source_path: Path, flags: list[str], compiler: str | None = None) -> Path:
    """Compile `source_path` with `flags` (once per source, flags and machine); returns the
    shared library."""
    compiler = compiler or default_compiler()
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C compiler: {compiler!r} is not on PATH (install gcc, or set CC)")
    source = source_path.read_bytes()
    key = hashlib.sha256(source + " ".join(flags + GUARD_FLAGS + LINK_FLAGS).encode()
                         + platform.machine().encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source_path.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, built = Path(tmp) / "kernel.o", Path(tmp) / target.name
        for command in ([compiler, *flags, *GUARD_FLAGS, "-c", str(source_path), "-o", str(obj)],
                        [compiler, *LINK_FLAGS, str(obj), "-o", str(built), "-lm"]):
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise KernelBuildError(f"{compiler} failed ({result.returncode}): {result.stderr.strip()[-800:]}")
        os.replace(built, target)
    return target


def load_once(what: str, load: Callable[[], Kernel], fallback: str) -> Kernel | None:
    """`load()` (build and open a kernel) on first use in this process; None where it cannot be,
    logged once with the path the engine takes instead (`fallback`)."""
    with _lock:
        if what not in _loaded:
            try:
                _loaded[what] = load()
                log.info("%s: C kernel %s", what, _loaded[what].path)
            except (KernelBuildError, OSError, subprocess.TimeoutExpired) as exc:
                log.warning("%s: C kernel unavailable (%s); using %s", what, exc, fallback)
                _loaded[what] = None
        return _loaded[what]


def build_or_exit(build: Callable[[], Path], what: str) -> None:
    """`python -m` entry of a kernel's module: build it now (images do, so containers never
    compile) and print the library; exit 1 with the reason where it cannot be built."""
    try:
        print(build())
    except (KernelBuildError, subprocess.TimeoutExpired) as exc:
        sys.exit(f"{what} not built: {exc}")
