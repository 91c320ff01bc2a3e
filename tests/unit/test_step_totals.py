"""A pool's step totals (what the router's latency model differences) and the first-token wait the
scheduler quotes at admission from its smoothed token rate (pure Python)."""
from __future__ import annotations

import pytest

from services.common.priority import HIGH, LOW, MEDIUM
from services.common.step import SamplingParams
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.policy import QoSPolicy, QoSSettings, create_policy
from services.scheduler.request import Request
from services.scheduler.step_totals import RATE_SMOOTHING, StepTotals, estimated_wait_ms
from tests.unit.test_batcher import LetterDecoder


def request(seq_id: int, priority: int, prompt_len: int, tenant: str = "") -> Request:
    prompt = list(range(3, 3 + prompt_len))
    return Request(request_id=f"r{seq_id}", seq_id=seq_id, priority=priority, tenant=tenant, prompt_ids=prompt,
                   sampling=SamplingParams(max_tokens=8), detokenizer=IncrementalDetokenizer(LetterDecoder(), prompt))


def test_totals_accumulate_and_the_rate_is_smoothed():
    totals = StepTotals()
    totals.record(0.5, 100, 2, 400)
    assert (totals.step_seconds, totals.worker_steps, totals.step_tokens, totals.step_kv_tokens) == (0.5, 2, 100, 400)
    assert totals.tokens_per_second == pytest.approx(200.0)       # the first step sets the rate
    totals.record(0.25, 100, 1, 600)
    assert (totals.step_seconds, totals.worker_steps, totals.step_tokens, totals.step_kv_tokens) == (0.75, 3, 200, 1000)
    assert totals.tokens_per_second == pytest.approx((1 - RATE_SMOOTHING) * 200 + RATE_SMOOTHING * 400)


def test_no_estimate_before_a_rate_is_measured():
    policy = create_policy("qos")
    policy.add(request(1, MEDIUM, 500))
    assert estimated_wait_ms(policy, set(), 0.0, MEDIUM, 100) == 0.0


def test_the_wait_is_the_lane_queue_and_prompt_at_its_share_of_the_rate():
    policy = create_policy("qos")
    for seq_id, prompt in enumerate((300, 200)):
        policy.add(request(seq_id, LOW, prompt))
    lane = policy.lane_of_priority(LOW)
    # Low alone backlogged: the whole rate is its.
    assert estimated_wait_ms(policy, set(), 1000.0, LOW, 100) == pytest.approx((500 + 100) / 1000 * 1000)
    # High running beside it: Low gets its weighted share only, and waits longer.
    high_lane = policy.lane_of_priority(HIGH)
    share = policy.share(lane, {lane, high_lane})
    assert share < 1
    assert estimated_wait_ms(policy, {high_lane}, 1000.0, LOW, 100) == pytest.approx(600 / (1000 * share) * 1000)
    # An empty lane: only the request's own prompt, at the share it would get.
    medium_lane = policy.lane_of_priority(MEDIUM)
    assert estimated_wait_ms(policy, set(), 1000.0, MEDIUM, 100) == pytest.approx(
        100 / (1000 * policy.share(medium_lane, {lane, medium_lane})) * 1000)



def test_with_tenant_fairness_another_tenants_flood_counts_only_up_to_the_share_it_takes():
    """The wait quoted to a tenant's request was the whole lane's queue: another tenant's flood,
    which fair sharing serves alongside rather than ahead, both pushed its SLO requests out and
    read out as the size of that flood (x-slo-ms=1 as a free probe)."""
    policy = QoSPolicy(QoSSettings(tenant_fairness=True))
    for seq_id in range(50):
        policy.add(request(seq_id, LOW, 200, tenant="a"))
    # b has nothing queued: a's flood is served beside its 100 tokens, about 100 of it meanwhile.
    assert estimated_wait_ms(policy, set(), 1000.0, LOW, 100, "b") == pytest.approx((100 + 100) / 1000 * 1000)
    assert estimated_wait_ms(policy, set(), 1000.0, LOW, 100, "b") == estimated_wait_ms(
        policy, set(), 1000.0, LOW, 100, "c")          # the same whatever a's flood holds beyond that
    policy.add(request(99, LOW, 300, tenant="b"))       # b's own queue counts whole, and earns a as much
    assert estimated_wait_ms(policy, set(), 1000.0, LOW, 100, "b") == pytest.approx((300 + 400 + 100) / 1000 * 1000)
    # Twice the others' weight: half as much of a's and of b's served meanwhile.
    assert estimated_wait_ms(policy, set(), 1000.0, LOW, 100, "c", weight=2.0) == pytest.approx(
        (50 + 50 + 100) / 1000 * 1000)
    fifo = QoSPolicy(QoSSettings(tenant_fairness=False))          # one line: everything queued is ahead
    for seq_id in range(50):
        fifo.add(request(seq_id, LOW, 200, tenant="a"))
    assert estimated_wait_ms(fifo, set(), 1000.0, LOW, 100, "b") == pytest.approx((10_000 + 100) / 1000 * 1000)
