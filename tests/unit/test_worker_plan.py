"""The worker's side of a StepPlan (services/worker/sequences.py): block grants as two packed
arrays, applied in order, and refused (table unchanged) when they do not fit the state."""
from __future__ import annotations

import pytest

from services.common.proto.qos.v1 import worker_pb2
from services.common.step import SamplingParams
from services.common.wire import engine_sampling, sampling_from_engine
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
    from services.common.step import TokenLogprobs
    tokens = [SampledToken(7, 101), SampledToken(3, 5, FinishReason.STOP, TokenLogprobs(-0.5, ((5, -0.5), (8, -1.25)))),
              SampledToken(9, 0, FinishReason.LENGTH, TokenLogprobs(-2.0)), SampledToken(4, 2**31 - 1)]
    answer = answer_tokens(worker_pb2.StepResult(step_id=1), tokens, packed)
    wire = worker_pb2.StepResult.FromString(answer.SerializeToString())
    assert bool(wire.tokens) is not packed and bool(wire.sampled_seq_ids) is packed   # the form asked for
    assert sampled_tokens(wire) == tokens       # logprobs only where a sequence asked, tops in order


def test_a_new_sequence_starts_at_its_cached_tokens_and_refuses_more_than_its_blocks_hold():
    table = SequenceTable(block_size=4)
    new = announce(1, 10)
    new.cached_tokens = 8                       # its first two blocks hold 8 tokens already
    batch = table.apply(worker_pb2.StepPlan(step_id=1, new_sequences=[new], scheduled_seq_ids=[1],
                                            scheduled_num_tokens=[2], granted_seq_ids=[1, 1, 1],
                                            granted_block_ids=[5, 6, 7]))
    assert [(w.position, len(w.token_ids)) for w in batch.sequences] == [(8, 2)]
    for cached, blocks, message in [(10, [5, 6, 7], "at least one must be computed"),
                                    (8, [5], "8 cached tokens but 1 blocks granted")]:
        wrong = announce(2, 10)
        wrong.cached_tokens = cached
        with pytest.raises(PlanError, match=message):
            table.apply(worker_pb2.StepPlan(step_id=2, new_sequences=[wrong], granted_seq_ids=[2] * len(blocks),
                                            granted_block_ids=blocks))


def test_a_cut_in_may_read_the_cached_blocks_the_step_in_flight_holds_but_not_write_them():
    from services.common.step import SequenceWork, StepBatch
    from services.worker.cut_ins import CutIns
    cut_ins = CutIns(block_size=4)
    cut_ins.host(StepBatch([SequenceWork(1, [3] * 4, 8, [10, 11, 12])]))
    reader = announce(2, 10)
    reader.cached_tokens = 8                    # blocks 10 and 11: the host's cached prefix
    cut_ins.check(worker_pb2.StepPlan(step_id=5, cut_in=True, new_sequences=[reader], scheduled_seq_ids=[2],
                                      scheduled_num_tokens=[2], granted_seq_ids=[2, 2, 2],
                                      granted_block_ids=[10, 11, 20]))
    writer = announce(3, 10)
    writer.cached_tokens = 4                    # it would write block 11
    with pytest.raises(PlanError, match="grants block 11, held by a sequence of the step in flight"):
        cut_ins.check(worker_pb2.StepPlan(step_id=6, cut_in=True, new_sequences=[writer], scheduled_seq_ids=[3],
                                          scheduled_num_tokens=[6], granted_seq_ids=[3, 3, 3],
                                          granted_block_ids=[10, 11, 20]))


def test_a_penalised_sequence_announced_again_counts_its_streamed_tokens_as_output():
    """After a preemption or a failover the scheduler announces the prompt plus the tokens already
    streamed (num_generated of them): the penalties count those as output, not as prompt, and the
    adjustments travel the hop unchanged (an older scheduler's repetition_penalty 0 means 1)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=1.0, repetition_penalty=1.25,
                            min_p=0.5, logit_bias=((4, -2.0), (9, 3.0)), allowed_token_ids=(9, 4, 11),
                            typical_p=0.75)
    new = worker_pb2.NewSequence(seq_id=1, prompt_token_ids=[3, 4, 5, 6, 7, 8], num_generated=2,
                                 sampling=engine_sampling(params))
    batch = SequenceTable().apply(worker_pb2.StepPlan(step_id=1, new_sequences=[new], scheduled_seq_ids=[1],
                                                      scheduled_num_tokens=[6], granted_seq_ids=[1],
                                                      granted_block_ids=[0]))
    [work] = batch.sequences
    assert work.sampling == params and work.sample
    assert list(work.history) == [3, 4, 5, 6, 7, 8] and work.output_start == 4     # output: [7, 8]
    older = worker_pb2.EngineSampling(temperature=0.0, top_p=1.0, max_tokens=8)
    assert sampling_from_engine(older).repetition_penalty == 1.0
