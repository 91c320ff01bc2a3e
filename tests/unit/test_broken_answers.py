"""A worker whose answers do not match its plans is failed and kept out of the pool; its
sequences finish on a healthy worker with exactly the tokens they would have had
(services/scheduler/answer_check.py, ContinuousBatcher.quarantine)."""
from __future__ import annotations

import asyncio

import pytest

from services.common.proto.qos.v1 import worker_pb2
from services.scheduler.answer_check import answer_mismatch
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.policy import create_policy
from services.scheduler.request import Phase
from services.scheduler.stats import state_metrics
from tests.unit.test_batcher import SimulatedWorker, expected_output, make_request, serve


class BrokenWorker(SimulatedWorker):
    """Takes every plan, answers with `mangle` applied to what a healthy worker would answer."""

    def __init__(self, index, num_blocks, mangle):
        super().__init__(index, num_blocks)
        self.mangle = mangle
        self.held_off = None

    async def execute(self, plan, sent=None):
        result = await super().execute(plan, sent)
        return self.mangle(plan, result)


def empty(plan, result):
    return worker_pb2.StepResult(step_id=result.step_id)


def unknown_sequence(plan, result):
    result.sampled_seq_ids.append(10_000)
    result.sampled_token_ids.append(5)
    return result


def doubled(plan, result):
    if result.sampled_seq_ids:
        result.sampled_seq_ids.append(result.sampled_seq_ids[0])
        result.sampled_token_ids.append(result.sampled_token_ids[0])
    return result


@pytest.mark.parametrize("mangle", [empty, unknown_sequence, doubled])
def test_a_worker_answering_against_its_plans_is_failed_and_its_requests_finish_elsewhere(mangle):
    broken = BrokenWorker(0, 64, mangle)
    requests = [make_request(i, prompt_len=6 + i, max_tokens=6) for i in range(8)]
    results, batcher, _ = asyncio.run(serve(requests, links=[broken, SimulatedWorker(1, 64)]))
    for request, (tokens, _, last) in zip(requests, results):
        assert tokens == expected_output(request), request.request_id
    assert broken.held_off == 30.0 and not broken.is_connected
    assert batcher.quarantines["sim-0"] == 1 and batcher.failovers["broken_answer"] >= 1
    metrics = {f.name: f for f in state_metrics(batcher)}
    assert metrics["qos_worker_quarantines"].samples[0].value == 1
    assert any(s.labels == {"reason": "broken_answer"} and s.value >= 1
               for s in metrics["qos_failovers"].samples)


def test_quarantine_doubles_for_a_worker_that_stays_broken():
    async def go():
        broken = BrokenWorker(0, 64, empty)
        batcher = ContinuousBatcher("sim", [broken], create_policy("fcfs"), 8, 16)
        for expected in (30.0, 60.0, 120.0):
            broken.restart()
            await batcher.quarantine(broken, "test")
            assert broken.held_off == expected
    asyncio.run(go())


class Planned:
    def __init__(self, seq_id, pending, phase=Phase.RUNNING):
        self.seq_id, self.pending, self.phase = seq_id, pending, phase


def test_answer_mismatch_names_what_is_wrong():
    plan = [Planned(1, 0), Planned(2, 0), Planned(3, 5), Planned(4, 0, Phase.FINISHED)]
    assert answer_mismatch(plan, [1, 2]) is None
    assert answer_mismatch(plan, [2, 1, 4]) is None          # a cancelled sequence's token is fine
    assert answer_mismatch(plan, []) == "no token for 2 of the 2 sequence(s) the step completed"
    assert answer_mismatch(plan, [1, 2, 9]) == "tokens for 1 sequence(s) not in the plan (e.g. 9)"
    assert answer_mismatch(plan, [1, 2, 3]) == "tokens for 1 sequence(s) still mid-prompt"
    assert answer_mismatch(plan, [1, 1, 2]) == "1 sequence(s) sampled twice"
    assert answer_mismatch([], []) is None
