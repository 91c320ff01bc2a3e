"""Admission control without a server: each refusal, its kind, the field it names and when it
says to retry (services/scheduler/admission.py)."""
from __future__ import annotations

import pytest

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import HIGH, LOW, MEDIUM
from services.common.proto.qos.v1 import common_pb2, worker_pb2
from services.common.step import SamplingParams
from services.scheduler.admission import (DEFAULT_MAX_TOKENS, MIN_SLO_RETRY_MS, Admission, PoolLimits,
                                          pool_limits)
from services.scheduler.policy import QoSPolicy, QoSSettings
from services.scheduler.request import Request

LIMITS = PoolLimits(max_context=1000, block_size=10, largest_worker_blocks=100)
CAPS = {HIGH: 1.0, MEDIUM: 0.7, LOW: 0.3}


def admission(waiting: int = 0, wait_ms: float = 0.0, max_queue: int = 8) -> Admission:
    return Admission("cpu", CAPS.__getitem__, lambda _p: waiting, lambda *_: wait_ms,
                     max_queue=max_queue, retry_after_ms=750)


def refusal(check, *args) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        check(*args)
    return caught.value


def sampling(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**fields)


def test_a_request_that_fits_gets_its_sampling_resolved():
    got = admission().check(MEDIUM, [1] * 100, sampling(max_tokens=50, temperature=0.0), 0, LIMITS)
    assert (got.max_tokens, got.temperature, got.top_p, got.seed) == (50, 0.0, 1.0, None)


def test_max_tokens_defaults_to_what_the_context_leaves():
    assert admission().check(HIGH, [1] * 100, sampling(), 0, LIMITS).max_tokens == DEFAULT_MAX_TOKENS
    assert admission().check(HIGH, [1] * 900, sampling(), 0, LIMITS).max_tokens == 100


@pytest.mark.parametrize("prompt, fields, field, words", [
    ([], {}, "prompt", "prompt is empty"),
    ([1] * 1000, {}, "prompt", "context window is 1000 tokens"),
    ([1] * 900, {"max_tokens": 101}, "sampling.max_tokens", "leaving 100"),
    ([1] * 10, {"temperature": -1.0}, "sampling.temperature", "temperature must be >= 0"),
    ([1] * 10, {"top_p": 0.0}, "sampling.top_p", "top_p must be in (0, 1]"),
    ([1] * 10, {"top_k": -2}, "sampling.top_k", "top_k must be >= 0"),
])
def test_invalid_requests_name_the_field(prompt, fields, field, words):
    error = refusal(admission().check, MEDIUM, prompt, sampling(**fields), 0, LIMITS)
    assert (error.kind, error.field, error.retry_after_ms) == (ErrorKind.INVALID, field, None)
    assert words in error.message


def test_a_request_over_its_class_cap_is_too_large_for_good():
    # Low may hold 30 of 100 blocks of 10 tokens: 300 tokens. 250 + 60 = 310 does not fit.
    error = refusal(admission().check, LOW, [1] * 250, sampling(max_tokens=60), 0, LIMITS)
    assert error.kind is ErrorKind.TOO_LARGE and error.reason == "kv_cap"
    assert error.retry_after_ms is None, "retrying the same request cannot help"
    assert "needs 31 KV blocks" in error.message and "at most 30" in error.message
    assert error.field == "sampling.max_tokens"
    # The same request fits Medium's 70% cap, and one token less fits Low's.
    admission().check(MEDIUM, [1] * 250, sampling(max_tokens=60), 0, LIMITS)
    admission().check(LOW, [1] * 250, sampling(max_tokens=50), 0, LIMITS)


def test_a_full_queue_says_when_to_retry():
    error = refusal(admission(waiting=8, max_queue=8).check, HIGH, [1] * 10, sampling(), 0, LIMITS)
    assert (error.kind, error.reason, error.retry_after_ms) == (ErrorKind.EXHAUSTED, "queue_full", 750)
    assert "high queue of pool cpu is full (8 waiting)" in error.message
    admission(waiting=7, max_queue=8).check(HIGH, [1] * 10, sampling(), 0, LIMITS)


@pytest.mark.parametrize("wait_ms, slo_ms, retry_ms", [(900.0, 500, 400), (520.0, 500, MIN_SLO_RETRY_MS)])
def test_a_missed_slo_is_refused_with_the_excess_as_retry_after(wait_ms, slo_ms, retry_ms):
    error = refusal(admission(wait_ms=wait_ms).check, MEDIUM, [1] * 10, sampling(), slo_ms, LIMITS)
    assert (error.kind, error.reason, error.field) == (ErrorKind.EXHAUSTED, "slo", "x-slo-ms")
    assert error.retry_after_ms == retry_ms
    assert f"exceeds x-slo-ms={slo_ms}" in error.message


def test_an_slo_that_can_be_met_or_none_passes():
    admission(wait_ms=400.0).check(MEDIUM, [1] * 10, sampling(), 500, LIMITS)
    admission(wait_ms=10_000.0).check(MEDIUM, [1] * 10, sampling(), 0, LIMITS)


def test_checks_run_in_order_invalid_before_limits():
    # Invalid and over a full queue at once: the client must fix the request first.
    error = refusal(admission(waiting=99).check, LOW, [], sampling(), 0, LIMITS)
    assert error.kind is ErrorKind.INVALID


def test_limits_come_from_connected_workers_only_and_need_one():
    error = refusal(pool_limits, [None, None], "cpu")
    assert (error.kind, error.reason) == (ErrorKind.UNAVAILABLE, "no_worker")
    assert error.retry_after_ms and "no worker of pool cpu is connected" in error.message
    small = worker_pb2.WorkerInfo(max_context=2048, block_size=16, num_blocks=50)
    large = worker_pb2.WorkerInfo(max_context=1024, block_size=32, num_blocks=400)
    assert pool_limits([None, small, large], "cpu") == PoolLimits(1024, 32, 400)


def test_with_tenant_fairness_a_full_queue_refuses_only_the_tenants_holding_their_share():
    """A tenant's flood filled a class's queue and every other tenant got queue_full (a lockout,
    and an oracle of the flood): now a full queue still takes a request from a tenant holding less
    than max_queue / tenants of it, and tells the refused one its own count only."""
    policy = QoSPolicy(QoSSettings(tenant_fairness=True))
    check = Admission("cpu", CAPS.__getitem__, policy.waiting, lambda *_: 0.0, max_queue=4,
                      retry_after_ms=750, tenant_waiting=policy.tenant_waiting).check
    made = []

    def arrive(tenant: str) -> Request:
        check(MEDIUM, [1] * 10, sampling(max_tokens=5), 0, LIMITS, None, tenant)
        request = Request(request_id=f"r{len(made)}", seq_id=len(made) + 1, priority=MEDIUM, tenant=tenant,
                          prompt_ids=[1] * 10, sampling=SamplingParams(max_tokens=5), detokenizer=None)
        policy.add(request)
        made.append(request)
        return request

    flood = [arrive("a") for _ in range(4)]                      # the queue is full: a's alone
    error = refusal(arrive, "a")
    assert (error.kind, error.reason, error.retry_after_ms) == (ErrorKind.EXHAUSTED, "queue_full", 750)
    assert "4 of your requests wait in it" in error.message
    arrive("b"), arrive("b")                                     # b's share of 4 between two: 2
    assert "2 of your requests" in refusal(arrive, "b").message
    arrive("c")                                                  # a third tenant: its share is 1
    assert policy.waiting(MEDIUM) == 7 and policy.tenant_waiting(MEDIUM, "c") == (1, 3)
    for request in flood:                                        # a's requests admitted to run
        policy.remove(request)
    assert policy.tenant_waiting(MEDIUM, "a") == (0, 3) and policy.waiting(MEDIUM) == 3
    arrive("a")                                                  # the queue has room again
    assert not policy._waiting_by_tenant.keys() - {(MEDIUM, t) for t in "abc"}


def test_without_tenant_fairness_a_full_queue_is_full_for_everyone():
    error = refusal(admission(waiting=8, max_queue=8).check, MEDIUM, [1] * 10, sampling(), 0, LIMITS, None, "b")
    assert "medium queue of pool cpu is full (8 waiting)" in error.message


def test_a_client_naming_a_new_tenant_each_time_still_meets_a_hard_bound():
    """A tenant with nothing queued holds less than any share: a client that sent every request
    under a new x-tenant (auth off) filled the queue without limit (1,960 of 2,000 queued with
    max_queue 10)."""
    policy = QoSPolicy(QoSSettings(tenant_fairness=True))
    check = Admission("cpu", CAPS.__getitem__, policy.waiting, lambda *_: 0.0, max_queue=10,
                      retry_after_ms=750, tenant_waiting=policy.tenant_waiting).check
    taken = 0
    for i in range(200):
        try:
            check(MEDIUM, [1] * 10, sampling(max_tokens=5), 0, LIMITS, None, f"t{i}")
        except ServiceError as error:
            assert error.reason == "queue_full" and "is full (10 waiting)" in error.message
            continue
        policy.add(Request(request_id=f"r{i}", seq_id=i + 1, priority=MEDIUM, tenant=f"t{i}", prompt_ids=[1] * 10,
                           sampling=SamplingParams(max_tokens=5), detokenizer=None))
        taken += 1
    assert taken == policy.waiting(MEDIUM) == 20
