"""The virtual-time pool (bench/sim/virtual_pool.py) behind bench/qos_virtual.py and
bench/tenant_service.py: the real scheduler over simulated steps, with cut-ins, steps waited and
KV peaks, the same on any host."""
from __future__ import annotations

import time

import pytest

from bench.qos_virtual import burst, run_policy
from bench.sim.accelerators import Accelerator
from bench.sim.virtual_pool import VirtualPool
from bench.sim.workload import SimRequest
from services.common.priority import HIGH, LOW, MEDIUM
from services.scheduler.policy import QoSSettings

# 10 ms a step + 1 ms a token: easy arithmetic. 1,024 blocks of 16 tokens.
SMALL = Accelerator("small", "cpu", 10.0, 1.0, 0.0, 16_384, 8, 64)


def test_a_request_on_an_idle_pool_gets_its_first_token_after_its_own_steps():
    pool = VirtualPool(SMALL)
    request = SimRequest(0, 0.0, MEDIUM, 100, 3)          # prompt in chunks of 64 and 36
    pool.run([request])
    assert request.pool_ttft_ms == pytest.approx((10 + 64) + (10 + 36))
    # Steps between its arrival and the step of its first token: its own first chunk's.
    assert pool.steps_waited[1] == 1
    assert request.finished_at == pytest.approx((74 + 46 + 2 * 11) / 1000)


def test_a_high_request_cuts_into_a_step_of_decodes_and_waits_no_step():
    low = [SimRequest(i, 0.0, LOW, 8, 50) for i in range(4)]     # one prefill step, then decodes
    high = SimRequest(4, 0.100, HIGH, 16, 2)                     # arrives while decodes compute
    pool = VirtualPool(SMALL)
    pool.run(low + [high])
    assert pool.cut_in_steps == 1
    # The cut-in is its own step (10 ms + 16 tokens) from the moment it arrived.
    assert high.pool_ttft_ms == pytest.approx(10 + 16)
    assert pool.steps_waited[5] == 0

    low = [SimRequest(i, 0.0, LOW, 8, 50) for i in range(4)]
    high = SimRequest(4, 0.100, HIGH, 16, 2)
    no_cut_ins = VirtualPool(SMALL, settings=QoSSettings(high_cut_in=False))
    no_cut_ins.run(low + [high])
    assert no_cut_ins.cut_in_steps == 0
    assert high.pool_ttft_ms > 10 + 16           # the rest of the step in flight, then its own
    assert no_cut_ins.steps_waited[5] == 0       # ... which is the next step


def test_behind_a_fcfs_backlog_a_high_request_waits_many_steps_and_qos_lets_it_by():
    def workload():
        flood = [SimRequest(i, 0.0, LOW, 512, 16) for i in range(40)]
        return flood + [SimRequest(40, 0.05, HIGH, 16, 2)]

    waited = {}
    for policy in ("fcfs", "qos"):
        pool = VirtualPool(SMALL, policy, QoSSettings(high_cut_in=False))
        pool.run(workload())
        waited[policy] = pool.steps_waited[41]
    assert waited["qos"] == 0
    assert waited["fcfs"] > 100


def test_low_never_holds_more_than_its_cap_under_a_flood():
    wide = Accelerator("wide", "cpu", 10.0, 1.0, 0.0, 16_384, 16, 2048)   # room for 16 at once
    pool = VirtualPool(wide)
    pool.run([SimRequest(i, 0.0, LOW, 1_000, 8) for i in range(30)])
    assert 0 < pool.kv_peak_blocks[LOW] <= 0.3 * pool.worker.pool.num_blocks
    fcfs = VirtualPool(wide, "fcfs")
    fcfs.run([SimRequest(i, 0.0, LOW, 1_000, 8) for i in range(30)])
    assert fcfs.kv_peak_blocks[LOW] > 0.3 * fcfs.worker.pool.num_blocks     # the cap is what holds it


def test_a_run_is_the_same_however_fast_the_host_is(monkeypatch):
    requests = burst(4096, 0.05, 10.0, 1.0, seed=3)
    first = run_policy(SMALL, "qos", requests, "first")
    clock = [1e6]

    def slow_host():                        # every reading of the host's clock 50 s later
        clock[0] += 50.0
        return clock[0]

    monkeypatch.setattr(time, "perf_counter", slow_host)
    again = run_policy(SMALL, "qos", requests, "again")
    assert again == first
    # The policy's window of shares runs on the simulated clock, not the host's.
    pool = VirtualPool(SMALL)
    end = pool.run([SimRequest(i, 0.01 * i, MEDIUM, 200, 8) for i in range(20)])
    moments = [at for at, _, _ in pool.batcher.policy._window]
    assert moments and all(0.0 <= at <= end for at in moments)


def test_the_burst_has_the_designs_counts_and_shapes_and_follows_its_seed():
    requests = burst(4096, 1.0, 10.0, 1.0, seed=0)
    by_class = {p: [r for r in requests if r.priority == p] for p in (HIGH, MEDIUM, LOW)}
    assert {p: len(rs) for p, rs in by_class.items()} == {HIGH: 200, MEDIUM: 500, LOW: 300}
    assert {(r.prompt_tokens, r.output_tokens) for r in by_class[LOW]} == {(3952, 128)}
    assert all(r.arrival < 1.0 for r in by_class[LOW] + by_class[MEDIUM])
    assert [r.arrival for r in requests] == sorted(r.arrival for r in requests)
    assert [r.arrival for r in burst(4096, 1.0, 10.0, 1.0, seed=0)] == [r.arrival for r in requests]
    assert [r.arrival for r in burst(4096, 1.0, 10.0, 1.0, seed=1)] != [r.arrival for r in requests]
