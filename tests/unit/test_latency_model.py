"""The routing latency model (step-time fit, per-class prediction, margin) and slo-cost routing."""
from __future__ import annotations

import pytest

from services.common.priority import HIGH, LOW, MEDIUM
from services.common.proto.qos.v1 import scheduler_pb2
from services.router.latency_model import LatencyModel, PoolReport, StepFit
from services.router.pools import pool_load
from services.router.routing import PoolLoad, PoolRouter, PoolSpec, RouteRequest

M = "model"


def reports(fixed_ms: float, per_token_ms: float, batches, per_kv_ms: float = 0.0, kv=None, **queue):
    """Cumulative reports of a pool whose steps take fixed + per_token x tokens (+ per_kv x KV
    tokens held), one step each."""
    seconds = tokens = steps = kv_sum = 0
    kv = kv or [0] * len(batches)
    for batch, held in zip(batches, kv):
        steps += 1
        tokens += batch
        kv_sum += held
        seconds += (fixed_ms + per_token_ms * batch + per_kv_ms * held) / 1000
        yield PoolReport(step_seconds=seconds, worker_steps=steps, step_tokens=tokens, steps=steps,
                         step_kv_tokens=kv_sum, kv_tokens=held, max_step_tokens=256, max_running=64, **queue)


def fitted(fixed_ms=10.0, per_token_ms=0.1, **queue) -> LatencyModel:
    model = LatencyModel()
    for report in reports(fixed_ms, per_token_ms, [16, 64, 256, 32, 128, 200, 8], **queue):
        model.report(report)
    return model


def test_step_fit_recovers_the_line_from_steps_of_several_sizes():
    model = fitted()
    model.ttft_ms(LOW, 1)         # the fit is solved when a prediction needs it
    fit = model.fit
    assert fit.fixed_ms == pytest.approx(10.0, rel=1e-6)
    assert fit.ms_per_token == pytest.approx(0.1, rel=1e-6)


def test_step_fit_separates_the_kv_term_when_context_varies_apart_from_batch():
    model = LatencyModel()
    for report in reports(8.0, 0.05, [16, 64, 256, 32, 128, 200, 8, 100], per_kv_ms=0.001,
                          kv=[5_000, 1_000, 20_000, 30_000, 2_000, 9_000, 40_000, 15_000]):
        model.report(report)
    fit = model.fit
    fit.solve()
    assert (fit.fixed_ms, fit.ms_per_token, fit.ms_per_kv_token) == pytest.approx((8.0, 0.05, 0.001), rel=1e-4)


def test_step_fit_with_one_batch_size_still_predicts_that_size():
    fit = StepFit()
    for _ in range(5):
        fit.add(64, 0, 16.4, 1)
    fit.solve()
    assert fit.step_ms(64) == pytest.approx(16.4)


def test_nothing_is_predicted_before_a_step_was_seen():
    model = LatencyModel()
    model.report(PoolReport())
    assert not model.known


def test_an_idle_pool_predicts_about_the_prompt_s_own_steps():
    model = fitted()
    # 100 tokens on an idle pool: one step of ~10 + 0.1 x 100 ms, give or take the amortised rate.
    assert 15 <= model.ttft_ms(LOW, 100) <= 40
    assert model.ttft_ms(LOW, 1000) > 3 * model.ttft_ms(LOW, 100)


def test_a_backlog_ahead_in_the_class_adds_its_tokens_at_the_class_share():
    idle = fitted(waiting=(0, 0, 1), waiting_tokens=(0, 0, 0), running=(0, 0, 1))
    backlog = fitted(waiting=(0, 5, 5), waiting_tokens=(0, 2000, 2000), running=(0, 8, 8))
    assert backlog.ttft_ms(LOW, 100) > idle.ttft_ms(LOW, 100) + 50
    # Medium's weight (3) beats Low's (2): the same tokens ahead wait less.
    assert backlog.ttft_ms(MEDIUM, 100) < backlog.ttft_ms(LOW, 100)
    # High goes ahead of everyone else's prefill: its queue is empty, so it waits least.
    assert backlog.ttft_ms(HIGH, 100) < backlog.ttft_ms(MEDIUM, 100)


def test_a_dispatch_counts_as_work_ahead_until_the_next_report():
    model = fitted(waiting=(0, 0, 3), waiting_tokens=(0, 0, 600), running=(0, 0, 8))
    before = model.ttft_ms(LOW, 100)
    model.dispatched(LOW, 500)
    assert model.ttft_ms(LOW, 100) > before
    assert model.ttft_ms(MEDIUM, 100) == fitted(waiting=(0, 0, 3), waiting_tokens=(0, 0, 600),
                                                running=(0, 0, 8)).ttft_ms(MEDIUM, 100)


def test_the_margin_follows_how_far_off_the_predictions_were():
    model = LatencyModel()
    for _ in range(50):
        model.observe(100.0, 250.0)
    assert model.margin == pytest.approx(2.5)
    for _ in range(200):
        model.observe(100.0, 50.0)
    assert model.margin == pytest.approx(0.5)


def test_pool_stats_become_a_report():
    stats = scheduler_pb2.PoolStats(
        workers=2, kv_blocks_total=100, steps=10, step_seconds=0.5, worker_steps=20, step_tokens=900,
        max_step_tokens=128, max_running=16,
        classes=[scheduler_pb2.ClassStats(priority=p, waiting=p, waiting_tokens=10 * p, running=1, weight=w)
                 for p, w in ((1, 5.0), (2, 3.0), (3, 2.0))])
    report = pool_load(stats).report
    assert report.waiting == (1, 2, 3) and report.waiting_tokens == (10, 20, 30)
    assert (report.workers, report.max_step_tokens, report.steps, report.step_tokens) == (2, 128, 10, 900)
    assert pool_load(scheduler_pb2.PoolStats()).report is None      # an old scheduler: no model


# --- slo-cost routing -----------------------------------------------------------------------------

GPU = PoolSpec("gpu", "cuda", frozenset({M}))
NPU = PoolSpec("npu", "npu", frozenset({M}))
CPU1 = PoolSpec("cpu1", "cpu", frozenset({M}))
CPU2 = PoolSpec("cpu2", "cpu", frozenset({M}))


def slo_router(pools, speeds: dict[str, tuple[float, float]], **queues) -> PoolRouter:
    """A slo-cost router whose pools reported steps of (fixed, per-token) ms and the given queues."""
    router = PoolRouter(list(pools), mode="slo-cost")
    for pool in pools:
        for report in reports(*speeds[pool.name], [16, 64, 256], **queues.get(pool.name, {})):
            router.update(pool.name, PoolLoad(healthy=True, free_kv=0.9, report=report))
    return router


SPEEDS = {"gpu": (5.0, 0.02), "npu": (15.0, 0.08), "cpu1": (60.0, 1.0), "cpu2": (60.0, 1.0)}


def test_slo_cost_takes_the_cheapest_pool_predicted_to_meet_the_slo():
    router = slo_router([GPU, NPU, CPU1], SPEEDS)
    # A 100-token prompt: ~200 ms on the CPU pool, ~25 ms on the NPU, ~10 ms on the GPU.
    assert router.route(RouteRequest(M, LOW, prompt_tokens=100, slo_ms=5_000)).pool == "cpu1"
    decision = router.route(RouteRequest(M, MEDIUM, prompt_tokens=100, slo_ms=100))
    assert (decision.pool, decision.rule) == ("npu", "slo-cost")
    assert 0 < decision.predicted_ttft_ms <= 100 / router.models["npu"].margin
    assert router.route(RouteRequest(M, MEDIUM, prompt_tokens=100, slo_ms=20)).pool == "gpu"


def test_high_keeps_its_strict_rule_under_slo_cost():
    decision = slo_router([GPU, NPU, CPU1], SPEEDS).route(RouteRequest(M, HIGH, prompt_tokens=10, slo_ms=60_000))
    assert (decision.pool, decision.rule) == ("gpu", "high-to-primary")


def test_when_no_pool_meets_the_slo_the_fastest_takes_it_but_low_waits_where_it_costs_least():
    router = slo_router([GPU, NPU, CPU1, CPU2], SPEEDS)
    decision = router.route(RouteRequest(M, MEDIUM, prompt_tokens=100, slo_ms=1))
    assert (decision.pool, decision.rule) == ("gpu", "slo-fastest")
    decision = router.route(RouteRequest(M, LOW, prompt_tokens=100, slo_ms=1))
    assert decision.pool in ("cpu1", "cpu2") and decision.rule == "slo-cheapest-late"


def test_a_backlogged_cheap_pool_is_passed_over():
    busy_cpu = {"cpu1": dict(waiting=(0, 0, 20), waiting_tokens=(0, 0, 20_000), running=(0, 0, 16))}
    router = slo_router([GPU, NPU, CPU1], SPEEDS, **busy_cpu)
    assert router.route(RouteRequest(M, LOW, prompt_tokens=100, slo_ms=5_000)).pool == "npu"


def test_pools_of_one_price_take_turns_and_a_burst_spills_over():
    router = slo_router([GPU, NPU, CPU1, CPU2], SPEEDS)
    chosen = []
    for _ in range(40):
        request = RouteRequest(M, LOW, prompt_tokens=200, slo_ms=2_000)
        decision = router.route(request)
        router.note_dispatch(decision.pool, request)
        chosen.append(decision.pool)
    assert chosen[:2] in (["cpu1", "cpu2"], ["cpu2", "cpu1"])
    # Each dispatch adds its prompt to the pool's predicted wait: the CPU pools fill up to the
    # SLO, then the NPU takes the rest.
    assert "npu" in chosen and chosen.count("cpu1") == chosen.count("cpu2")


def test_an_unmeasured_pool_is_judged_by_the_overflow_rule():
    router = PoolRouter([GPU, CPU1], mode="slo-cost")
    router.update("gpu", PoolLoad(healthy=True))
    router.update("cpu1", PoolLoad(healthy=True, queued=0, free_kv=0.9, ttft_ms=0.0))
    assert router.route(RouteRequest(M, LOW, prompt_tokens=10)).rule == "slo-cost-unmeasured"
    router.update("cpu1", PoolLoad(healthy=True, queued=50, free_kv=0.9))
    assert router.route(RouteRequest(M, LOW, prompt_tokens=10)).pool == "gpu"


def test_within_a_price_a_conversation_goes_back_to_the_pool_that_holds_its_cache():
    router = slo_router([GPU, NPU, CPU1, CPU2], SPEEDS)
    request = RouteRequest(M, LOW, prompt_tokens=100, slo_ms=5_000, affinity=7)
    first = router.route(request)
    router.note_dispatch(first.pool, request)              # remembered where it went
    other = "cpu2" if first.pool == "cpu1" else "cpu1"
    assert router.route(RouteRequest(M, LOW, prompt_tokens=100, slo_ms=5_000)).pool == other   # turn order
    again = router.route(request)
    assert (again.pool, again.rule) == (first.pool, "slo-cost-cache-affinity")
    # Never a pricier pool for its cache: remembered on the NPU, it still takes the cheapest that meets the SLO.
    router.affinity.remember(7, "npu")
    assert router.route(request).pool in ("cpu1", "cpu2")
    # Nor one that misses the SLO: the turn order goes on.
    router.affinity.remember(7, first.pool)
    assert router.route(RouteRequest(M, LOW, prompt_tokens=100, slo_ms=150, affinity=7)).rule != \
        "slo-cost-cache-affinity"
