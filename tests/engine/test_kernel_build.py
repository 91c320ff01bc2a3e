"""Building the engine's C kernels: a kernel whose vectors are wider than the registers its flags
allow is refused, where GCC would have compiled it into code that keeps every vector in memory."""
from __future__ import annotations

import platform
import shutil
import subprocess

import pytest

from services.engine import kernel_build
from services.engine.kernel_build import KernelBuildError, default_compiler

# y += a * x sixteen floats at a time, in one 64-byte vector: AVX-512's width.
WIDE = """typedef float v16 __attribute__((vector_size(64)));
void axpy(float *y, const float *x, float a, int n) {
    for (int i = 0; i + 16 <= n; i += 16) {
        v16 u, v;
        __builtin_memcpy(&u, x + i, sizeof u);
        __builtin_memcpy(&v, y + i, sizeof v);
        v += u * a;
        __builtin_memcpy(y + i, &v, sizeof v);
    }
}
"""


def gcc() -> bool:
    if shutil.which(default_compiler()) is None:
        return False
    version = subprocess.run([default_compiler(), "--version"], capture_output=True, text=True).stdout
    return "Free Software Foundation" in version


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not gcc(),
                    reason="the guard is GCC's warnings, the flags x86's")
def test_vectors_wider_than_the_registers_are_refused(tmp_path, monkeypatch):
    """Built for AVX2 (16 vector registers of 8 floats), the 16-float vector would live in memory:
    the linear kernel written so ran at 3 GFLOPS where F.linear ran 56-110. Refused, the engine
    keeps the torch path; with AVX-512's flags the same source builds."""
    monkeypatch.setenv("QOS_SERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "wide.c"
    source.write_text(WIDE)
    with pytest.raises(KernelBuildError, match="vector-operation-performance|psabi"):
        kernel_build.build_library(source, ["-O2", "-fPIC", "-mavx2", "-mfma"])
    assert kernel_build.build_library(source, ["-O2", "-fPIC", "-mavx512f"]).exists()
