"""services/common/gc_pauses.py: the startup heap frozen once per process (or not, with
QOS_GC_FREEZE=0), and each collection's pause counted by generation for Prometheus."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from services.common.gc_pauses import GcPauses

ROOT = Path(__file__).resolve().parents[2]

# In a process of its own: a freeze is once per process and would freeze the test runner's heap.
FREEZE_TWICE = """
import gc
from services.common.gc_pauses import freeze_startup_heap
startup = [[i] for i in range(50_000)]          # long-lived containers, as imports leave them
gc.collect()
tracked_before = len(gc.get_objects(generation=2))
frozen = freeze_startup_heap("test")
print(frozen, gc.get_freeze_count(), tracked_before, len(gc.get_objects(generation=2)), freeze_startup_heap("test"))
"""


def run_freeze(env_value: str | None) -> list[int]:
    env = {k: v for k, v in os.environ.items() if k != "QOS_GC_FREEZE"}
    if env_value is not None:
        env["QOS_GC_FREEZE"] = env_value
    out = subprocess.run([sys.executable, "-c", FREEZE_TWICE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return [int(n) for n in out.split()]


def test_the_startup_heap_is_frozen_out_of_full_collections_once():
    frozen, freeze_count, tracked_before, tracked_after, second = run_freeze(None)
    assert frozen == freeze_count > 50_000
    assert tracked_before > 50_000 and tracked_after < 1_000    # a full collection walks almost nothing now
    assert second == 0                                          # once per process


def test_qos_gc_freeze_0_leaves_the_heap_in_the_collectors_scans():
    frozen, freeze_count, tracked_before, tracked_after, _ = run_freeze("0")
    assert frozen == freeze_count == 0
    assert tracked_after >= tracked_before > 50_000


def test_each_collection_is_counted_by_the_generation_it_collected():
    registry = CollectorRegistry()
    pauses = GcPauses()
    registry.register(pauses)
    try:
        before = {g: registry.get_sample_value("qos_gc_pause_seconds_count", {"generation": str(g)}) for g in (0, 2)}
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        count = {g: registry.get_sample_value("qos_gc_pause_seconds_count", {"generation": str(g)}) for g in (0, 2)}
    finally:
        pauses.close()
    assert count[2] - before[2] == 2
    assert count[0] - before[0] >= 1        # young collections also run on their own meanwhile
    assert registry.get_sample_value("qos_gc_pause_seconds_sum", {"generation": "2"}) > 0
    assert registry.get_sample_value("qos_gc_pause_seconds_bucket", {"generation": "2", "le": "+Inf"}) == count[2]
    gc.collect(2)                            # closed: no longer counted
    assert registry.get_sample_value("qos_gc_pause_seconds_count", {"generation": "2"}) == count[2]
