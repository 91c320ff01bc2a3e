"""bench/flood_probe.py: the flood's jobs, and the CPU it reads from /proc per thread and per process."""
from __future__ import annotations

import os
import sys
import threading

import pytest

from bench.flood_probe import CpuSampler, flood_jobs, thread_cpu
from bench.loadgen import Job

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


def test_the_flood_keeps_every_low_and_medium_job_and_the_high_ones_sent_in_the_window():
    jobs = [Job("low", "x", 1, 1, 0.5), Job("medium", "x", 1, 1, 5.0), Job("high", "x", 1, 1, 0.2),
            Job("high", "x", 1, 1, 1.29), Job("high", "x", 1, 1, 1.3), Job("high", "x", 1, 1, 9.0)]
    flood, high = flood_jobs(jobs, window=1.3)
    assert [j.priority for j in flood] == ["low", "medium"]
    assert [j.at for j in high] == [0.2, 1.29]


def test_a_busy_thread_is_seen_with_its_cpu_and_nice_value():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        before = thread_cpu(os.getpid())
        for _ in range(50):
            after = thread_cpu(os.getpid())
            grown = [key for key, s in after.items() if s > before.get(key, 0.0)]
            if any(key[0] == worker.native_id for key in grown):
                break
            stop.wait(0.05)
    finally:
        stop.set()
        worker.join()
    (_tid, name, nice), = [key for key in after if key[0] == worker.native_id and key in grown]
    assert name and nice == os.getpriority(os.PRIO_PROCESS, 0)     # the kernel's name: "python" here
    assert thread_cpu(999_999_999) == {}        # a process that is gone has no threads


def test_cores_per_process_come_from_the_samples_nearest_the_window():
    sampler = CpuSampler()
    names = {10: "router", 11: "worker-0", 12: "clients", 13: "clients"}
    sampler.samples = [
        (100.0, names, {(10, 1, "python", 0): 1.0, (11, 2, "python", 0): 2.0, (12, 3, "python", 10): 0.0}),
        (100.9, names, {(10, 1, "python", 0): 1.1, (11, 2, "python", 0): 2.1, (12, 3, "python", 10): 0.0}),
        (101.0, names, {(10, 1, "python", 0): 1.5, (11, 2, "python", 0): 2.8, (12, 3, "python", 10): 0.2,
                        (13, 4, "python", 10): 0.3}),
    ]
    span, cores, threads = sampler.between(100.02, 101.04)
    assert span == pytest.approx(1.0)
    assert cores == pytest.approx({"router": 0.5, "worker-0": 0.8, "clients": 0.5})   # both clients
    assert [(p, round(c, 2)) for p, _, _, c in threads] == [("worker-0", 0.8), ("router", 0.5),
                                                            ("clients", 0.3), ("clients", 0.2)]
    assert sampler.between(100.0, 100.01)[0] == 0.0      # one sample: nothing to compare
