"""bench/tenant_service.py: VTC's measurement of service between tenants, on hand-made logs and on
the real scheduler in virtual time."""
from __future__ import annotations

import pytest

from bench.tenant_service import ServiceLog, jain, max_service_diff, measure, vtc_bound
from bench.sim.accelerators import Accelerator


def log_of(times, service, backlog) -> ServiceLog:
    log = ServiceLog({}, ["a", "b"])
    log.times, log.service, log.backlog = times, service, [frozenset(b) for b in backlog]
    return log


def test_the_difference_counts_only_intervals_in_which_the_one_behind_was_backlogged():
    # b is ahead by 100 at t=1, but a only starts waiting at t=2; from then b gains 30 more.
    log = log_of([0, 1, 2, 3, 4], [(0, 0), (0, 100), (0, 100), (10, 140), (10, 140)],
                 [{"b"}, {"b"}, {"a", "b"}, {"a", "b"}, set()])
    assert max_service_diff(log) == 30
    # Where a waited all along, all of b's lead counts.
    log = log_of([0, 1, 2, 3, 4], [(0, 0), (0, 100), (0, 100), (10, 140), (10, 140)],
                 [{"a", "b"}] * 4 + [set()])
    assert max_service_diff(log) == 130


def test_jain_is_one_for_equal_shares_and_one_over_n_for_one_tenant_served():
    equal = log_of([0, 5, 10, 15], [(0, 0), (50, 50), (100, 100), (150, 150)], [{"a", "b"}] * 3 + [set()])
    assert jain(equal, window_s=5) == pytest.approx(1.0)
    starved = log_of([0, 5, 10, 15], [(0, 0), (50, 0), (100, 0), (150, 0)], [{"a", "b"}] * 3 + [set()])
    assert jain(starved, window_s=5) == pytest.approx(0.5)


def test_the_bound_is_twice_the_larger_of_the_longest_prompt_and_the_memory_a_batch_holds():
    pool = Accelerator("p", "cpu", 1.0, 0.1, 0.0, 10_000, 4, 256)
    requests = [(0.0, "a", 300, 50), (0.0, "b", 100, 900)]
    assert vtc_bound(requests, pool, cap=0.7) == 2 * min(7_000, 4 * 1_000)
    assert vtc_bound([(0.0, "a", 9_000, 10)], pool, cap=0.7) == 2 * 9_000


def test_with_fair_queueing_two_backlogged_tenants_stay_within_the_bound_and_one_fifo_does_not():
    requests = [(0.0, "a", 2048, 32)] * 60 + [(0.0, "b", 64, 512)] * 200
    result = measure("two", requests)
    assert result["fair"]["max_service_diff"] <= result["vtc_bound"]
    assert result["fifo"]["max_service_diff"] > result["vtc_bound"]
    assert result["fair"]["jain_index"] > result["fifo"]["jain_index"]
