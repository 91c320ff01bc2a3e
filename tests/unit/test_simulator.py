"""The cluster simulator (bench/sim/): its pools against hand-computed step times, the fast
queueing model against the real scheduler, and the routing modes end to end on a small fleet."""
from __future__ import annotations

import math
import random

import pytest

from bench.sim.accelerators import ACCELERATORS, Accelerator
from bench.sim.cluster import PoolPlan, SimCluster
from bench.sim.fast_pool import FastPool
from bench.sim.pace import MIN_STEPS, MachinePace
from bench.sim.step_pool import StepPool
from bench.sim.workload import SimRequest, poisson, trace_replay
from services.common.priority import HIGH, LOW, MEDIUM

SIMPLE = Accelerator("simple", "cuda", fixed_ms=10.0, ms_per_token=0.1, ms_per_kv_token=0.0, kv_tokens=100_000,
                     max_running=8, max_step_tokens=64)


def run_pool(pool, requests: list[SimRequest]) -> None:
    """Feed arrivals and step ends in time order until the pool is idle."""
    pending = sorted(requests, key=lambda r: r.arrival)
    while pending or pool.next_event() is not None:
        if pending and (pool.next_event() is None or pending[0].arrival <= pool.next_event()):
            request = pending.pop(0)
            pool.submit(request, request.arrival)
        else:
            pool.step_end(pool.next_event())


@pytest.mark.parametrize("kind", [FastPool, StepPool])
def test_one_request_takes_its_prefill_chunks_then_one_step_per_token(kind):
    pool = kind("p", SIMPLE)
    request = SimRequest(0, 0.0, MEDIUM, prompt_tokens=100, output_tokens=5)
    run_pool(pool, [request])
    # Prefill: 64 then 36 tokens (the step budget), the first token at the end of the second
    # step; then 4 decode steps of one token each.
    prefill = (10 + 6.4) + (10 + 3.6)
    assert request.ttft_ms == pytest.approx(prefill, rel=1e-6)
    assert request.finished_at * 1000 == pytest.approx(prefill + 4 * 10.1, rel=1e-6)
    assert pool.kv_used() == 0


@pytest.mark.parametrize("kind", [FastPool, StepPool])
def test_a_high_request_goes_ahead_of_a_low_backlog(kind):
    pool = kind("p", SIMPLE)
    lows = [SimRequest(i, 0.0, LOW, prompt_tokens=200, output_tokens=20) for i in range(6)]
    high = SimRequest(99, 0.05, HIGH, prompt_tokens=30, output_tokens=2)
    run_pool(pool, lows + [high])
    assert high.ttft_ms < 60                               # the step in flight, then its own
    assert max(r.ttft_ms for r in lows) > 5 * high.ttft_ms
    assert all(r.finished_at is not None for r in lows + [high])


@pytest.mark.parametrize("kind", [FastPool, StepPool])
def test_a_slower_machine_pace_stretches_each_step_it_starts(kind):
    pool = kind("p", SIMPLE)
    pool.pace = MachinePace([2.0, 1.0], window_s=0.02)     # twice the fit for the first 20 ms
    request = SimRequest(0, 0.0, MEDIUM, prompt_tokens=100, output_tokens=1)
    run_pool(pool, [request])
    # The first chunk starts at 0 (pace 2), the second at 32.8 ms (pace 1).
    assert request.ttft_ms == pytest.approx(2 * (10 + 6.4) + (10 + 3.6), rel=1e-6)


def test_machine_pace_is_measured_over_fitted_step_time_per_window():
    fits = {"a": {"fixed_ms": 10.0, "ms_per_token": 1.0, "ms_per_kv_token": 0.0},
            "b": {"fixed_ms": 20.0, "ms_per_token": 0.0, "ms_per_kv_token": 0.0}}
    # Cumulative [t, step_seconds, steps, tokens, kv]: window 0 (0-5 s) pool a runs 10 steps of
    # 10 tokens in 0.3 s (fit: 0.2 s, pace 1.5); window 1 has too few steps to judge (keeps
    # 1.5); window 2: a at the fit, b at half its fit: (0.2 + 0.1) / (0.2 + 0.2) = 0.75.
    samples = {"a": [[0.0, 0.0, 0, 0, 0], [4.0, 0.3, 10, 100, 0], [6.0, 0.32, 10 + MIN_STEPS - 1, 101, 0],
                     [12.0, 0.52, 19 + MIN_STEPS, 201, 0]],
               "b": [[0.0, 0.0, 0, 0, 0], [12.0, 0.1, 10, 0, 0]],
               "unfitted": [[0.0, 0.0, 0, 0, 0], [1.0, 9.0, 10, 0, 0]]}
    pace = MachinePace.measured(samples, fits)
    assert pace.factors == pytest.approx([1.5, 1.5, 0.75])
    assert pace(-1.0) == pytest.approx(1.5) and pace(99.0) == pytest.approx(0.75)
    assert pace.spread() == pytest.approx((0.75, 1.5, 1.5))


def test_fast_pool_shares_a_backlogged_step_5_3_2():
    pool = FastPool("p", Accelerator("wide", "cuda", 10.0, 0.1, 0.0, 10_000_000, 4096, 256))
    requests = [SimRequest(i, 0.0, p, prompt_tokens=5_000, output_tokens=1) for i, p in
                enumerate([HIGH, MEDIUM, LOW] * 20)]
    for r in requests:
        pool.submit(r, 0.0)
    for _ in range(200):                                   # all three classes stay backlogged
        pool.step_end(pool.busy_until)
    served = pool.served
    total = served[HIGH] + served[MEDIUM] + served[LOW]
    assert served[HIGH] / total == pytest.approx(0.5, abs=0.03)
    assert served[MEDIUM] / total == pytest.approx(0.3, abs=0.03)


def test_fast_pool_keeps_low_under_its_kv_cap():
    acc = Accelerator("small", "cuda", 10.0, 0.1, 0.0, kv_tokens=10_000, max_running=64, max_step_tokens=512)
    pool = FastPool("p", acc)
    peak = 0
    for i in range(30):
        pool.submit(SimRequest(i, 0.0, LOW, prompt_tokens=500, output_tokens=50), 0.0)
    while pool.busy_until is not None:
        peak = max(peak, pool.kv[LOW])
        pool.step_end(pool.busy_until)
    assert 0 < peak <= 0.3 * acc.kv_tokens


def test_the_fast_model_agrees_with_the_real_scheduler_on_a_small_cluster():
    plans = [PoolPlan("gpu0", ACCELERATORS["h100"], 1.0), PoolPlan("npu0", ACCELERATORS["910b"], 0.3),
             PoolPlan("cpu0", ACCELERATORS["xeon-spr"], 0.1)]
    results = {kind: SimCluster(plans, "slo-cost", pool_kind=kind).run(trace_replay("azure-conv", 6, 40), 40)
               for kind in ("step", "fast")}
    for c in ("high", "medium", "low"):
        assert results["fast"].p50_ttft_ms[c] == pytest.approx(results["step"].p50_ttft_ms[c], rel=0.25)
    assert results["fast"].cost_units == pytest.approx(results["step"].cost_units, rel=0.1)


def test_slo_cost_routing_costs_less_than_primary_and_keeps_high_on_the_gpu():
    plans = [PoolPlan(f"gpu{i}", ACCELERATORS["h100"], 1.0) for i in range(2)] + \
            [PoolPlan(f"npu{i}", ACCELERATORS["910b"], 0.3) for i in range(2)] + \
            [PoolPlan(f"cpu{i}", ACCELERATORS["xeon-spr"], 0.1) for i in range(4)]
    results = {mode: SimCluster(plans, mode).run(list(poisson("azure-conv", 12, 60, seed=1)), 60)
               for mode in ("primary", "slo-cost")}
    primary, slo = results["primary"], results["slo-cost"]
    assert primary.served_share["cuda"] == 1.0
    assert slo.cost_units < 0.8 * primary.cost_units
    assert slo.served_share["cpu"] > 0 and slo.served_share["npu"] > 0
    assert slo.slo_attainment["high"] == pytest.approx(primary.slo_attainment["high"], abs=0.01)
    assert slo.unfinished == primary.unfinished == 0


def test_a_replayed_request_is_routed_by_the_routers_estimate_and_its_outside_time_feeds_the_margin():
    """A real run replayed: the router predicts from the prompt length it saw (its estimate), and
    the time a request spent outside the pools counts in its TTFT and in what the router learns."""
    def run(outside_ms: float, routed: int) -> tuple[list[SimRequest], float]:
        cluster = SimCluster([PoolPlan("gpu0", SIMPLE, 1.0, primary=True)], "slo-cost", pool_kind="step")
        requests = [SimRequest(i, 0.5 * i, MEDIUM, prompt_tokens=300, output_tokens=2, routed_prompt_tokens=routed,
                               outside_ms=outside_ms) for i in range(60)]
        cluster.run(requests, 31)
        return requests, cluster.router.models["gpu0"].margin

    plain, plain_margin = run(0.0, 0)
    outside, outside_margin = run(40.0, 0)
    estimated, estimated_margin = run(0.0, 75)
    for a, b in zip(plain, outside):
        assert b.pool_ttft_ms == pytest.approx(a.pool_ttft_ms)
        assert b.ttft_ms == pytest.approx(a.ttft_ms + 40.0)
    assert outside_margin > plain_margin + 0.5                 # 40 ms on a ~70 ms prediction
    later = slice(5, None)                                     # once the pool has reported a step
    assert all(e.predicted_ttft_ms < p.predicted_ttft_ms for e, p in zip(estimated[later], plain[later]))
    assert estimated_margin > 2 * plain_margin                 # a quarter of the prompt seen: the margin makes up


def test_prompt_tokens_a_replayed_run_served_from_its_prefix_cache_are_not_computed_and_bill_at_the_discount():
    def run(cached: int) -> tuple[SimRequest, float]:
        cluster = SimCluster([PoolPlan("gpu0", SIMPLE, 1.0, primary=True)], "primary", pool_kind="step")
        request = SimRequest(0, 0.0, MEDIUM, prompt_tokens=128, output_tokens=1, cached_tokens=cached)
        return request, cluster.run([request], 1).cost_units

    plain, plain_cost = run(0)
    cached, cached_cost = run(64)
    assert plain.ttft_ms == pytest.approx(2 * 10 + 12.8)          # two chunks of 64
    assert cached.ttft_ms == pytest.approx(10 + 6.4)              # the uncached 64 only
    multiplier = plain_cost / 129
    assert cached_cost == pytest.approx((129 - 64 * (1 - 0.5)) * multiplier)


def test_a_step_pool_with_prefix_caching_shares_a_replayed_prompt_prefix_and_reads_its_blocks_once():
    # The real pool's step-time fit was measured on the KV blocks it held: a prefix cached for many
    # sequences is held once, and its blocks count in every step's KV. A replayed run's pool holds
    # them the same way (the scheduler's own prefix cache), and says what it served.
    kv_bound = Accelerator("kv", "cpu", fixed_ms=10.0, ms_per_token=0.1, ms_per_kv_token=0.01, kv_tokens=100_000,
                           max_running=8, max_step_tokens=64)
    shared = list(range(100, 132))                                     # two full blocks
    first = SimRequest(0, 0.0, MEDIUM, 36, 4, prompt_ids=shared + [1, 2, 3, 4])
    second = SimRequest(1, 0.001, MEDIUM, 36, 40, prompt_ids=shared + [5, 6, 7, 8])
    third = SimRequest(2, 0.2, MEDIUM, 36, 4, prompt_ids=shared + [9, 10, 11, 12])
    pool = StepPool("p", kv_bound, prefix_caching=True)
    shared_steps = []
    plan = pool._plan

    def recording_plan(now):
        ends = plan(now)
        running = pool.batcher.running[0]
        if pool.plans and len(running) > 1:
            shared_steps.append((pool.kv_used(), sum(len(r.blocks) for r in running), len(running)))
        return ends
    pool._plan = recording_plan
    run_pool(pool, [first, second, third])
    assert (first.cached_tokens, third.cached_tokens) == (0, 32)      # found by the pool, not given
    assert shared_steps
    # Every sequence references the same two prefix blocks; the pool holds (and a step reads) them once.
    for kv_tokens, referenced, running in shared_steps:
        assert kv_tokens == (referenced - 2 * (running - 1)) * 16
    plain = StepPool("p", kv_bound)
    copies = [SimRequest(r.request_id, r.arrival, MEDIUM, 36, r.output_tokens) for r in (first, second, third)]
    run_pool(plain, copies)
    assert copies[2].ttft_ms > third.ttft_ms                          # its 32 cached tokens not computed


def test_trace_replay_arrives_at_the_asked_rate_and_classes_follow_the_lengths():
    rows = 19_366                                          # bench/traces/azure2023_conv.csv
    requests = trace_replay("azure-conv", rate=100, duration_s=rows / 100)   # the whole trace, once
    assert len(requests) == pytest.approx(rows, rel=0.01)
    assert all(a.arrival <= b.arrival for a, b in zip(requests, requests[1:]))
    for r in requests[:200]:
        if r.prompt_tokens > 2048:
            assert r.priority == LOW


def test_a_resampled_p99_interval_holds_the_p99_and_narrows_with_more_values():
    from bench.harness import bootstrap_interval, quantile
    rng = random.Random(1)
    few = [rng.expovariate(1.0) for _ in range(100)]
    many = [rng.expovariate(1.0) for _ in range(5_000)]
    for values in (few, many):
        low, high = bootstrap_interval(values, 0.99)
        assert low <= quantile(values, 0.99) <= high <= max(values)
    width = [(lambda lo_hi: (lo_hi[1] - lo_hi[0]) / quantile(v, 0.99))(bootstrap_interval(v, 0.99))
             for v in (few, many)]
    assert width[1] < width[0] / 2
    assert all(math.isnan(x) for x in bootstrap_interval([], 0.99))     # as quantile([])


def test_the_real_routers_margins_are_read_from_its_metrics_page():
    from bench.cost_report import margins_from_metrics
    page = ("# HELP qos_route_prediction_margin Routing latency model: the factor\n"
            "# TYPE qos_route_prediction_margin gauge\n"
            'qos_route_prediction_margin{pool="primary"} 1.5\n'
            'qos_route_prediction_margin{pool="cheap"} 3.25\n'
            'qos_route_prediction_error_ms_count{pool="cheap",priority="low"} 7.0\n')
    assert margins_from_metrics(page) == {"primary": 1.5, "cheap": 3.25}
    assert margins_from_metrics("") == {}
