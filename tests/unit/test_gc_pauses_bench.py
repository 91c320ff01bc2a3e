"""bench/gc_pauses.py: its summary of the rounds, and QOS_GC_FREEZE=0 reaching a real cluster's
services (the baseline is really unfrozen)."""
from __future__ import annotations

import os

import pytest

from bench.gc_pauses import FREEZE_ENV, measure, summary
from bench.harness import model_or_bench


def run(collections: dict, seconds: dict, frozen: int) -> dict:
    return {"router": {"collections": collections, "seconds": seconds, "frozen_objects": frozen}}


def test_summary_adds_the_rounds_up():
    runs = [run({0: 10, 1: 2, 2: 1}, {0: 0.01, 1: 0.004, 2: 0.03}, 0),
            run({0: 8, 1: 1, 2: 1}, {0: 0.008, 1: 0.002, 2: 0.05}, 0)]
    figures = summary(runs, "router")
    assert figures["full_collections"] == 2
    assert figures["full_pause_mean_ms"] == pytest.approx(40.0)         # (30 + 50) ms over 2
    assert figures["young_collections"] == 21
    assert figures["gc_seconds"] == pytest.approx(0.104)
    assert summary([run({0: 3, 1: 0, 2: 0}, {0: 0.001, 1: 0.0, 2: 0.0}, 5)], "router")["full_pause_mean_ms"] == 0.0


@pytest.mark.slow
def test_each_mode_reaches_every_service():
    saved = os.environ.get(FREEZE_ENV)
    try:
        model = model_or_bench(None)
        unfrozen = measure("unfrozen", model, batches=1, requests=20, tokens=2)
        frozen = measure("frozen", model, batches=1, requests=20, tokens=2)
    finally:
        if saved is None:
            os.environ.pop(FREEZE_ENV, None)
        else:
            os.environ[FREEZE_ENV] = saved
    assert all(unfrozen[s]["frozen_objects"] == 0 for s in ("router", "scheduler", "worker"))
    assert all(frozen[s]["frozen_objects"] > 10_000 for s in ("router", "scheduler", "worker"))
