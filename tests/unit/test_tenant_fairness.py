"""Tenants inside a priority class (services/scheduler/tenant_queue.py), on the real batcher and
QoS policy over a simulated worker: a tenant's flood does not make another tenant's requests wait
behind it, and backlogged tenants share the class's tokens by weight."""
from __future__ import annotations

import pytest

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import LOW
from services.scheduler.request import Phase, Request
from tests.unit.test_qos_scheduling import Harness


def admitted_before(h: Harness, target: Request, others: list[Request]) -> int:
    """How many of `others` got their first token before `target` did."""
    for _ in range(20_000):
        if target.output_ids:
            return sum(1 for r in others if r.first_token_at is not None and r.first_token_at < target.first_token_at)
        h.step()
    raise AssertionError("no progress")


@pytest.mark.parametrize("fair", [True, False])
def test_a_flood_does_not_make_another_tenant_wait_behind_it(fair):
    h = Harness(max_running=4, max_step_tokens=64, tenant_fairness=fair)
    flood = [h.submit(LOW, prompt_len=20, max_tokens=20, tenant="a") for _ in range(100)]
    h.step()                                        # a's first four are running
    b = h.submit(LOW, prompt_len=20, max_tokens=20, tenant="b")
    ahead = admitted_before(h, b, flood)
    if fair:
        assert ahead <= 6, ahead                    # the four running, at most one more each side
    else:
        assert ahead == 100                         # first come, first served inside the class


def test_backlogged_tenants_share_the_class_by_weight():
    h = Harness(max_running=8, max_step_tokens=64)
    for _ in range(60):
        h.submit(LOW, prompt_len=30, max_tokens=200, tenant="heavy", weight=3.0)
        h.submit(LOW, prompt_len=30, max_tokens=200, tenant="light", weight=1.0)
    for _ in range(400):
        h.step()
    served = {t: sum(len(r.output_ids) + r.computed for r in h.requests if r.tenant == t)
              for t in ("heavy", "light")}
    share = served["heavy"] / (served["heavy"] + served["light"])
    assert abs(share - 0.75) <= 0.08, served


def test_a_tenant_served_alone_owes_nothing_when_another_arrives():
    h = Harness(max_running=4, max_step_tokens=64)
    alone = [h.submit(LOW, prompt_len=20, max_tokens=300, tenant="a") for _ in range(4)]
    h.run_until_all_finished(max_steps=2_000)        # a alone: ~1,300 tokens, nobody else waiting
    assert all(r.output_ids for r in alone)
    others = [h.submit(LOW, prompt_len=20, max_tokens=20, tenant="b") for _ in range(12)]
    a = h.submit(LOW, prompt_len=20, max_tokens=20, tenant="a")
    # b arrived where service stood, not at 0: a's next request is not held back until b's
    # twelve have been served what a got alone.
    ahead = admitted_before(h, a, others)
    assert ahead <= 5, ahead


def test_decodes_count_against_their_tenant_like_prompts():
    # a runs three sequences with short prompts, b one with a long prompt: by prompts alone b was
    # served more (100 tokens against 30), but a's three decode three tokens a step to b's one, so
    # by the time b's sequence ends (100 tokens later) a is ahead by far (330 against 200) and the
    # freed slot goes to b's waiting request, though a's waited longer.
    h = Harness(max_running=4, max_step_tokens=256)
    for _ in range(3):
        h.submit(LOW, prompt_len=10, max_tokens=300, tenant="a")
    b_running = h.submit(LOW, prompt_len=100, max_tokens=100, tenant="b")
    h.step()
    a_next = h.submit(LOW, prompt_len=10, max_tokens=5, tenant="a")
    b_next = h.submit(LOW, prompt_len=10, max_tokens=5, tenant="b")
    while b_running.phase is not Phase.FINISHED:
        h.step()
    h.step()                                        # the freed slot is taken
    assert b_next.output_ids and not a_next.output_ids


def test_a_cancelled_waiting_request_failed_before_the_next_step_leaves_the_queue():
    """Cancelled, then ended by fail_waiting (an adapter unloaded under it) before the step that
    reaps cancellations: _finish skipped a cancelled request's removal and the reaping skipped a
    finished one, so it stayed queued, and its tenant counted as waiting, for good."""
    h = Harness(max_running=1, max_step_tokens=64, tenant_fairness=True)
    h.submit(LOW, prompt_len=20, max_tokens=50, tenant="a")
    h.step()                                           # a's first runs; the next waits
    waiting = h.submit(LOW, prompt_len=20, max_tokens=5, tenant="b")
    h.batcher.cancel(waiting)
    assert h.batcher.fail_waiting(lambda r: r is waiting, ServiceError(ErrorKind.UNSUPPORTED, "gone")) == 1
    h.step()
    assert h.policy.waiting(LOW) == 0 and not len(h.policy) and h.policy.tenant_waiting(LOW, "b") == (0, 1)
