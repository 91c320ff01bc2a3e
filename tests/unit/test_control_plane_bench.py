"""bench/control_plane_cpu.py: the per-request / per-chunk split, and the bare relay baseline
actually relays (every request gets every chunk it asked for) and is charged for it."""
from __future__ import annotations

import os

import pytest

from bench.control_plane_cpu import Costs, measure_bare, process_cpu_s


def test_the_split_charges_one_chunk_batches_to_requests_and_the_rest_to_chunks():
    costs = Costs.fit(one_chunk_s=0.2, many_chunks_s=0.5, requests=100, chunks=10)
    assert costs.per_request_ms == pytest.approx(2.0)           # 0.2 s over 100 requests
    assert costs.per_chunk_ms == pytest.approx(0.3)             # 0.3 s more over 1,000 more chunks
    assert Costs.fit(0.2, 0.1, 100, 10).per_chunk_ms == 0.0     # noise never makes a chunk pay back


def test_process_cpu_grows_with_work_done():
    before = process_cpu_s(os.getpid())
    total = 0
    for i in range(3_000_000):
        total += i
    assert process_cpu_s(os.getpid()) > before


@pytest.mark.slow
def test_the_bare_relay_streams_every_chunk_and_costs_cpu_in_both_processes():
    costs = measure_bare(requests=100, chunks=4, rounds=1, gap_s=0.001)
    # send_batch raises unless every request got exactly the tokens it asked for, so reaching
    # here means the relay relayed; both processes did measurable work for it.
    assert set(costs) == {"router", "scheduler"}
    assert all(c.per_request_ms > 0 for c in costs.values())
