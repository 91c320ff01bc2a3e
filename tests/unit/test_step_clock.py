"""Short steps while High is around (services/scheduler/step_clock.py, `high_step_ms`): the
pool's step time learnt from its steps, each step planned within the budget with High's work
never cut, the decodes left out going first next time, and no cut when High is gone."""
from __future__ import annotations

import pytest

from services.common.config_file import ConfigError, parse_config
from services.common.priority import HIGH, LOW
from services.scheduler.policy import QoSSettings
from services.scheduler.step_clock import MIN_FIT_STEPS, StepClock, StepCost
from tests.unit.test_qos_scheduling import Harness

FIXED_MS, MS_PER_TOKEN, MS_PER_CONTEXT = 5.0, 0.1, 0.01
CAP_MS = 20.0


def test_a_step_cost_charges_decodes_and_chunks_by_tokens_and_context():
    cost = StepCost(10.0, MS_PER_TOKEN, MS_PER_CONTEXT)
    # Decodes after 99, 199, 299, 399 tokens: 1.1, 2.1, 3.1 ms fit in 10 (6.3), 4.1 would not.
    assert cost.decodes_within([99, 199, 299, 399]) == 3
    assert cost.ms_left == pytest.approx(10.0 - 6.3)
    # A chunk after 100 tokens: each token costs 0.11 ms plus 1 ms for the context before it.
    assert cost.tokens_within(100, 500) == int((3.7 - 1.0) / 0.11)
    assert cost.tokens_within(1_000, 500) == 0


def test_the_clock_learns_the_step_time_and_budgets_only_while_high_is_around():
    clock = StepClock(high_step_ms=CAP_MS)
    for tokens, context in [(10, 1_000), (100, 2_000), (50, 8_000), (200, 500), (30, 3_000)] * 2:
        clock.observe(tokens, context, FIXED_MS + MS_PER_TOKEN * tokens + MS_PER_CONTEXT * context)
    assert clock.measured >= MIN_FIT_STEPS
    assert clock.budget(high_present=False, now=100.0) is None
    budget = clock.budget(high_present=True, now=100.0)
    assert budget.ms_left == pytest.approx(CAP_MS - FIXED_MS)
    assert (budget.ms_per_token, budget.ms_per_context_token) == pytest.approx((MS_PER_TOKEN, MS_PER_CONTEXT))
    clock.high_arrived(99.5)                               # none in the pool, one just arrived
    assert clock.budget(high_present=False, now=100.0) is not None


def test_high_step_ms_must_not_be_negative():
    with pytest.raises(ValueError, match="high_step_ms"):
        QoSSettings(high_step_ms=-1.0)
    with pytest.raises(ConfigError, match="high_step_ms"):
        parse_config({"scheduler": {"high_step_ms": -5}})


def short_step_harness() -> Harness:
    """16 Low sequences decoding with ~300-token contexts (3.1 ms a decode by the costs above:
    ~55 ms for a step of all of them), steps kept to 20 ms while High is around."""
    h = Harness(num_blocks=12_000, max_step_tokens=256, high_step_ms=CAP_MS)   # Low's 30%: all 16 whole
    clock = h.batcher.step_clock
    clock.observe = lambda *measured: None                 # the costs above, not this machine's
    clock.fit.fixed_ms, clock.fit.ms_per_token, clock.fit.ms_per_kv_token = FIXED_MS, MS_PER_TOKEN, MS_PER_CONTEXT
    clock.measured = MIN_FIT_STEPS
    for _ in range(16):
        h.submit(LOW, prompt_len=300, max_tokens=400)
    while any(r.pending > 1 for r in h.requests):
        h.step()
    return h


def step_ms(plan) -> float:
    """The plan's step time by the costs above (after the step: computed includes its tokens)."""
    return FIXED_MS + sum(MS_PER_TOKEN * n + MS_PER_CONTEXT * r.computed for r, n in plan.scheduled)


def test_while_high_is_around_steps_keep_to_the_budget_and_every_low_sequence_keeps_decoding():
    h = short_step_harness()
    lows = list(h.requests)
    assert len(h.step()[0].scheduled) == 16                # no High yet: every decode, one step
    high = h.submit(HIGH, prompt_len=40, max_tokens=30)
    plan = h.step()[0]
    assert high.output_ids                                 # its whole prompt went, in this step
    assert dict((r, n) for r, n in plan.scheduled)[high] == 40
    # 40 High tokens (~4.4 ms) and as many 3.1 ms decodes as fit the 15 ms left: 3.
    assert sum(1 for r, _ in plan.scheduled if r.priority == LOW) == 3
    decoded: set = set()
    for _ in range(6):
        before = {r: r.computed for r in lows}
        plan = h.step()[0]
        assert step_ms(plan) <= CAP_MS
        decoded |= {r for r in lows if r.computed > before[r]}
    assert decoded == set(lows)                            # in turn: nobody left behind
    assert high.phase.name == "RUNNING" and high.computed == 40 + 6   # High's decodes never wait


def test_steps_are_not_cut_once_high_is_gone():
    h = short_step_harness()
    high = h.submit(HIGH, prompt_len=10, max_tokens=2)
    while high.phase.name != "FINISHED":
        h.step()
    h.batcher.step_clock.last_high_at = float("-inf")     # its arrival is long past
    assert sum(1 for r, _ in h.step()[0].scheduled if r.priority == LOW) == 16
