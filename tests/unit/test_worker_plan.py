"""The worker's side of a StepPlan (services/worker/sequences.py): block grants as two packed
arrays, applied in order, and refused (table unchanged) when they do not fit the state."""
from __future__ import annotations

import pytest

from services.common.proto.qos.v1 import worker_pb2
from services.common.step import SamplingParams
from services.common.wire import engine_sampling
from services.worker.sequences import PlanError, SequenceTable


def announce(seq_id: int, prompt_len: int) -> worker_pb2.NewSequence:
    return worker_pb2.NewSequence(seq_id=seq_id, prompt_token_ids=list(range(3, 3 + prompt_len)),
                                  sampling=engine_sampling(SamplingParams(temperature=0.0, max_tokens=4)))


def test_granted_blocks_join_each_block_table_in_order():
    table = SequenceTable()
    table.apply(worker_pb2.StepPlan(step_id=1, new_sequences=[announce(1, 20), announce(2, 5)],
                                    scheduled_seq_ids=[1, 2], scheduled_num_tokens=[20, 5],
                                    granted_seq_ids=[1, 2, 1], granted_block_ids=[7, 3, 9]))
    assert table.sequences[1].block_table == [7, 9] and table.sequences[2].block_table == [3]
    batch = table.apply(worker_pb2.StepPlan(step_id=2, granted_seq_ids=[2], granted_block_ids=[4]))
    assert table.sequences[2].block_table == [3, 4] and not batch.sequences


@pytest.mark.parametrize("seq_ids, block_ids, message", [
    ([1, 1], [7], "granted_seq_ids and granted_block_ids differ in length"),
    ([1, 5], [7, 8], "blocks granted to sequence 5, unknown to this worker"),
])
def test_grants_that_do_not_fit_are_refused_and_change_nothing(seq_ids, block_ids, message):
    table = SequenceTable()
    table.apply(worker_pb2.StepPlan(step_id=1, new_sequences=[announce(1, 20)]))
    with pytest.raises(PlanError, match=message):
        table.apply(worker_pb2.StepPlan(step_id=2, granted_seq_ids=seq_ids, granted_block_ids=block_ids))
    assert table.sequences[1].block_table == []


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "a-message-each"])
def test_an_answer_carries_each_sampled_token_and_why_it_ended_in_either_form(packed):
    from services.common.step import FinishReason, SampledToken
    from services.common.wire import answer_tokens, sampled_tokens
    tokens = [SampledToken(7, 101), SampledToken(3, 5, FinishReason.STOP), SampledToken(9, 0, FinishReason.LENGTH),
              SampledToken(4, 2**31 - 1)]
    answer = answer_tokens(worker_pb2.StepResult(step_id=1), tokens, packed)
    wire = worker_pb2.StepResult.FromString(answer.SerializeToString())
    assert bool(wire.tokens) is not packed and bool(wire.sampled_seq_ids) is packed   # the form asked for
    assert sampled_tokens(wire) == tokens
