"""Host memory for CPU steps (services/engine/host_memory.py): freed memory kept for reuse, then
handed back once after loading; weights on 2 MiB pages where the kernel allows."""
from __future__ import annotations

import platform

import pytest
import torch

from services.engine.host_memory import HUGE_PAGE, huge_page_buffer, keep_freed_memory, release_freed_memory


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the malloc thresholds and malloc_trim are glibc's")
def test_memory_freed_while_loading_is_handed_back_once():
    assert keep_freed_memory()
    # 40 tensors of 4 MiB, each under the mmap threshold: they come from the heap, and freed
    # they stay resident (the point of keep_freed_memory) until released.
    pieces = [torch.ones(1 << 20) for _ in range(40)]
    del pieces
    before = resident_bytes()
    assert release_freed_memory()
    assert before - resident_bytes() > 100 << 20


def test_a_huge_page_buffer_is_aligned_and_usable():
    buffer = huge_page_buffer(3 * HUGE_PAGE // 2 + 7, torch.bfloat16)
    assert buffer.numel() == 3 * HUGE_PAGE // 2 + 7 and buffer.data_ptr() % HUGE_PAGE == 0
    buffer.fill_(1.5)
    assert buffer.float().sum().item() == 1.5 * buffer.numel()
