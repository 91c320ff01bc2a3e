"""Python's cyclic garbage collector in a serving process: the heap startup leaves is frozen out of
its scans, and every collection's pause is measured (Prometheus, `qos_gc_pause_seconds`).

Why: a collection holds the GIL for as long as it walks the objects of the generations it
collects, and a full one (generation 2) walks every tracked object in the process: measured
2026-12-02 on this project's 2-core machine, 32-36 ms in the router (58,000 objects after its
imports), 8-13 ms in the scheduler (38,000), with everything in them waiting, High's next chunk
included. Nearly all of those objects are startup's (modules, classes, the tokenizer, the model's
Python side) and live as long as the process; a flood's requests allocate enough to run full
collections during it. `gc.freeze()` once the service serves moves what exists then into the
permanent generation, which no collection walks; later objects are collected as before, and
reference counting frees frozen objects as usual (only a cycle among them is never reclaimed).
vLLM, SGLang and Ray Serve do the same after their startup.

QOS_GC_FREEZE=0 in a service's environment leaves its heap unfrozen (bench/gc_pauses.py uses it
for the baseline).

The pauses are timed in a `gc.callbacks` hook, which runs inside the collection, on whichever
thread triggered it: it only adds to plain lists (no lock: taking one there could deadlock with
the same thread holding it when the collection began), and a collector reads them at scrape time.
"""
from __future__ import annotations

import bisect
import gc
import logging
import os
import time

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger(__name__)

FREEZE_ENV = "QOS_GC_FREEZE"
# Upper bounds, seconds: a young collection takes ~0.1-1 ms here, a full one over a startup heap 10-40.
BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
GENERATIONS = (0, 1, 2)

_frozen = False


def freeze_startup_heap(service: str) -> int:
    """Once per process (later calls do nothing): collect what startup left as garbage, then
    freeze the rest. Returns the objects frozen (0 when QOS_GC_FREEZE=0 or already done)."""
    global _frozen
    if _frozen:
        return 0
    _frozen = True
    if os.environ.get(FREEZE_ENV, "1") == "0":
        log.info("%s: %s=0, the startup heap stays in the collector's scans", service, FREEZE_ENV)
        return 0
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d startup objects frozen out of garbage collection (%.0f ms)", service, frozen,
             (time.perf_counter() - started) * 1000)
    return frozen


class GcPauses(Collector):
    """Times every collection of this process from the moment it is created (one per process:
    a second one would count each pause twice)."""

    def __init__(self):
        # Per generation: counts per bucket (the last for pauses beyond BUCKETS), total seconds.
        self.counts = {g: [0] * (len(BUCKETS) + 1) for g in GENERATIONS}
        self.seconds = dict.fromkeys(GENERATIONS, 0.0)
        self._started = 0.0
        gc.callbacks.append(self._observe)

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info["generation"]
        self.counts[generation][bisect.bisect_left(BUCKETS, pause)] += 1
        self.seconds[generation] += pause

    def close(self) -> None:
        """Stop timing (tests; a service times its collections until it exits)."""
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)

    def collect(self):
        pauses = HistogramMetricFamily(
            "qos_gc_pause_seconds", "Time each garbage collection held the process (with the GIL), by the "
            "oldest generation it collected", labels=["generation"])
        for generation in GENERATIONS:
            counts, cumulative, buckets = self.counts[generation], 0, []
            for bound, count in zip((*map(str, BUCKETS), "+Inf"), counts):
                cumulative += count
                buckets.append((bound, cumulative))
            pauses.add_metric([str(generation)], buckets, self.seconds[generation])
        yield pauses
        yield GaugeMetricFamily("qos_gc_frozen_objects", "Objects frozen out of garbage collection at startup "
                                "(0: QOS_GC_FREEZE=0, or not serving yet)", value=gc.get_freeze_count())


_pauses: GcPauses | None = None


def watch_gc(registry: CollectorRegistry) -> GcPauses:
    """The process's GcPauses (made on first use), registered in `registry`."""
    global _pauses
    if _pauses is None:
        _pauses = GcPauses()
    registry.register(_pauses)
    return _pauses
