"""The autoscaling rule on made-up time: each reason to scale out, the limits, the cooldowns that
keep it from flapping, and scale-in only after a quiet spell."""
from __future__ import annotations

from services.common.config import AutoscaleConfig
from services.common.config_file import parse_config
from services.scheduler.autoscale import PoolSignals, ScaleAdvisor


def signals(workers=1, high_waiting=0, waiting=None, running=0, kv_used=0, kv_total=1000) -> PoolSignals:
    return PoolSignals(workers=workers, high_waiting=high_waiting,
                       waiting=high_waiting if waiting is None else waiting, running=running,
                       max_running=64, kv_used=kv_used, kv_total=kv_total)


def advisor(**config) -> ScaleAdvisor:
    defaults = dict(scale_out_cooldown_s=10.0, scale_in_cooldown_s=30.0, scale_in_after_s=20.0)
    return ScaleAdvisor(AutoscaleConfig(**{**defaults, **config}), min_workers=1, max_workers=3,
                        high_ttft_objective_ms=200.0)


def run(advice: ScaleAdvisor, seconds: range, make) -> list[int]:
    return [advice.update(make(t), float(t)) for t in seconds]


def test_a_high_backlog_over_the_threshold_adds_one_worker_per_cooldown_up_to_max():
    advice = advisor()
    desired = run(advice, range(0, 40), lambda t: signals(workers=1, high_waiting=150, running=64))
    assert desired[0] == 2 and desired[9] == 2 and desired[10] == 3       # one step per cooldown
    assert max(desired) == 3 and desired[-1] == 3                          # never past max_workers
    assert advice.reason == "High backlog 150 > 100"


def test_a_backlog_at_the_threshold_is_not_enough():
    advice = advisor()
    assert set(run(advice, range(0, 30), lambda t: signals(high_waiting=100, running=64))) == {1}


def test_high_ttft_over_its_sla_adds_a_worker_once_there_are_enough_samples():
    advice = advisor()
    for i in range(9):
        advice.observe_high_ttft(450.0, 0.0)
    assert advice.update(signals(running=64, waiting=5), 1.0) == 1        # 9 samples: no verdict
    advice.observe_high_ttft(450.0, 1.0)
    assert advice.update(signals(running=64, waiting=0), 2.0) == 1        # nothing waits: no queue to cut
    assert advice.update(signals(running=64, waiting=5), 3.0) == 2
    assert advice.reason == "High TTFT P99 450 ms > 200 ms"


def test_kv_use_over_the_line_must_last():
    advice = advisor(kv_high=0.9, kv_high_for_s=5.0)
    desired = run(advice, range(0, 10), lambda t: signals(running=40, kv_used=950))
    assert desired[:5] == [1] * 5 and desired[5] == 2 and "KV use 95%" in advice.reason
    advice = advisor(kv_high=0.9, kv_high_for_s=5.0)
    wobble = run(advice, range(0, 30), lambda t: signals(running=40, kv_used=950 if t % 4 else 100))
    assert set(wobble) == {1}


def test_scale_in_after_a_quiet_spell_and_a_cooldown_down_to_min():
    advice = advisor()
    run(advice, range(0, 11), lambda t: signals(workers=2, high_waiting=500))     # 2, then 3 at t=10
    assert advice.desired == 3
    desired = run(advice, range(11, 200), lambda t: signals(workers=3, running=2))
    drops = [t for t, (a, b) in zip(range(12, 200), zip(desired, desired[1:])) if b < a]
    # Idle from t=11: the first step down at t=40 (scale_in_cooldown_s after the change at t=10,
    # and 20 s idle), the next one 30 s later; never under min_workers.
    assert drops == [40, 70] and desired[-1] == 1
    assert advice.reason.startswith("load 1% < 25%")


def test_a_busy_pool_does_not_scale_in():
    advice = advisor(min_workers=1)
    run(advice, range(0, 1), lambda t: signals(high_waiting=500))
    desired = run(advice, range(1, 300), lambda t: signals(workers=2, running=60, waiting=20))
    assert set(desired) == {2}


def test_limits_come_from_the_pool_config():
    config = parse_config({"autoscale": {"max_workers": 4}, "workers": [{}, {}]})
    assert config.pools[0].worker_limits() == (2, 4)
    assert parse_config({}).pools[0].worker_limits() == (1, 1)                  # no scaling by default
    for bad, words in [({"max_workers": 1}, "below min_workers"), ({"min_workers": 0}, "min_workers must be >= 1, got 0"),
                       ({"kv_high": 1.5}, "kv_high must be")]:
        try:
            parse_config({"autoscale": bad, "workers": [{}, {}]})
        except ValueError as error:
            assert words in str(error)
        else:
            raise AssertionError(f"{bad} accepted")
