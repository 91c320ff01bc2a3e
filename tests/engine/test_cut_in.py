"""Cut-ins (services/worker/cut_ins.py): a step run inside another, at a pause in its forward pass,
gives both steps what they would have computed one after the other, and the worker runs a cut-in
that arrives mid-step there (answered first) or refuses one that touches the step in flight."""
from __future__ import annotations

import asyncio

import torch

from services.common.drain import Drain
from services.common.proto.qos.v1 import worker_pb2
from services.common.step import SamplingParams, SequenceWork, StepBatch
from services.common.wire import engine_sampling
from services.worker.server import WorkerService
from tests.tiny_models import make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = list(range(5, 100))          # the step in flight: a 95-token prompt and a decode
SHORT = list(range(200, 212))       # the cut-in: a 12-token prompt


def host_batch(blocks_a: list[int]) -> StepBatch:
    return StepBatch([SequenceWork(1, LONG, 0, blocks_a, GREEDY)])


def cut_in_batch(blocks_b: list[int]) -> StepBatch:
    return StepBatch([SequenceWork(2, SHORT, 0, blocks_b, GREEDY)])


def test_a_step_run_between_the_layers_of_another_changes_neither(tiny_model_dir):
    blocks_a, blocks_b = list(range(0, 8)), list(range(8, 10))
    one_after_other = make_engine(tiny_model_dir)
    expected_a = one_after_other.step(host_batch(blocks_a)).tokens
    expected_b = one_after_other.step(cut_in_batch(blocks_b)).tokens

    nested = make_engine(tiny_model_dir)
    inner: list = []
    def pause():
        if not inner:                      # after the first layer only
            inner.append(nested.step(cut_in_batch(blocks_b)).tokens)
    outer = nested.step(host_batch(blocks_a), pause).tokens
    assert inner == [expected_b] and outer == expected_a
    # The caches hold the same K/V: the next decode of each sequence agrees too.
    for engine in (one_after_other, nested):
        engine.next_tokens = [engine.step(StepBatch([
            SequenceWork(1, [expected_a[0].token_id], len(LONG), blocks_a, GREEDY, 1),
            SequenceWork(2, [expected_b[0].token_id], len(SHORT), blocks_b, GREEDY, 1)])).tokens]
    assert nested.next_tokens == one_after_other.next_tokens


def announce(seq_id: int, prompt: list[int]) -> worker_pb2.NewSequence:
    return worker_pb2.NewSequence(seq_id=seq_id, prompt_token_ids=prompt, sampling=engine_sampling(GREEDY))


def plan(step_id: int, seq_id: int, prompt: list[int], blocks: list[int], cut_in: bool = False):
    return worker_pb2.StepPlan(step_id=step_id, new_sequences=[announce(seq_id, prompt)],
                               scheduled_seq_ids=[seq_id], scheduled_num_tokens=[len(prompt)],
                               granted_seq_ids=[seq_id] * len(blocks), granted_block_ids=blocks, cut_in=cut_in)


def worker_with_cut_in_mid_step(tiny_model_dir, *cut_ins: worker_pb2.StepPlan):
    """A worker service whose next step gets `cut_ins` offered as soon as it starts computing,
    and the depth of every engine step it runs."""
    service = WorkerService(make_engine(tiny_model_dir), Drain("test worker", 1.0))
    host, step, depths = service.cut_ins.host, service.engine.step, []
    depth = [0]
    def hosting(batch):
        host(batch)
        assert all(service.cut_ins.offer(cut_in) for cut_in in cut_ins)
    def counted_step(batch, pause=None):
        depth[0] += 1
        depths.append(depth[0])
        try:
            return step(batch, pause)
        finally:
            depth[0] -= 1
    service.cut_ins.host, service.engine.step = hosting, counted_step
    return service, depths


def test_the_worker_runs_a_cut_in_inside_the_step_in_flight_and_answers_it_first(tiny_model_dir):
    reference = make_engine(tiny_model_dir)
    expected_long = reference.step(host_batch(list(range(8)))).tokens[0].token_id
    expected_short = reference.step(cut_in_batch([8, 9])).tokens[0].token_id

    service, depths = worker_with_cut_in_mid_step(tiny_model_dir, plan(2, 2, SHORT, [8, 9], cut_in=True))
    answers: list[worker_pb2.StepResult] = []
    answers.append(service._run_plan(plan(1, 1, LONG, list(range(8))), answers.append))
    assert [a.step_id for a in answers] == [2, 1]          # the cut-in's answer first
    assert depths == [1, 2]                                # ... computed inside the other step
    assert [a.tokens[0].token_id for a in answers] == [expected_short, expected_long]
    assert not any(a.error for a in answers)
    assert set(service.table.sequences) == {1, 2}


def test_a_cut_in_that_touches_the_step_in_flight_is_refused_and_the_step_goes_on(tiny_model_dir):
    reference = make_engine(tiny_model_dir)
    expected_long = reference.step(host_batch(list(range(8)))).tokens[0].token_id
    # Block 3 belongs to sequence 1, which the step in flight is writing.
    service, depths = worker_with_cut_in_mid_step(tiny_model_dir, plan(2, 2, SHORT, [3, 9], cut_in=True))
    answers: list[worker_pb2.StepResult] = []
    answers.append(service._run_plan(plan(1, 1, LONG, list(range(8))), answers.append))
    assert [a.step_id for a in answers] == [2, 1] and depths == [1]
    assert "grants block 3, held by a sequence of the step in flight" in answers[0].error
    assert answers[1].tokens[0].token_id == expected_long and not answers[1].error
    assert set(service.table.sequences) == {1}


def test_a_cut_in_run_as_a_step_of_its_own_takes_no_other_cut_in(tiny_model_dir):
    """A cut-in that came while no step was open runs as the worker's step; a later cut-in is
    not nested inside it (that would delay the first token it computes) but queues behind it."""
    service = WorkerService(make_engine(tiny_model_dir), Drain("test worker", 1.0))
    step, offered, depths = service.engine.step, [], []
    def offering_step(batch, pause=None):
        depths.append(len(depths) + 1)
        offered.append(service.cut_ins.offer(plan(3, 3, list(range(300, 307)), [10], cut_in=True)))
        return step(batch, pause)
    service.engine.step = offering_step
    answers: list[worker_pb2.StepResult] = []
    answers.append(service._run_plan(plan(2, 2, SHORT, [8, 9], cut_in=True), answers.append))
    assert offered == [False] and depths == [1]
    assert [a.step_id for a in answers] == [2] and not answers[0].error


def test_cut_ins_that_arrive_together_run_as_one_step_with_an_answer_each(tiny_model_dir):
    other = list(range(300, 307))
    reference = make_engine(tiny_model_dir)
    expected = [reference.step(StepBatch([SequenceWork(seq_id, prompt, 0, blocks, GREEDY)])).tokens[0].token_id
                for seq_id, prompt, blocks in ((2, SHORT, [8, 9]), (3, other, [10]))]
    service, depths = worker_with_cut_in_mid_step(tiny_model_dir, plan(2, 2, SHORT, [8, 9], cut_in=True),
                                                  plan(3, 3, other, [10], cut_in=True))
    answers: list[worker_pb2.StepResult] = []
    answers.append(service._run_plan(plan(1, 1, LONG, list(range(8))), answers.append))
    assert [a.step_id for a in answers] == [2, 3, 1] and depths == [1, 2]     # one nested step
    assert [[t.seq_id for t in a.tokens] for a in answers] == [[2], [3], [1]]
    assert [a.tokens[0].token_id for a in answers[:2]] == expected


def test_a_long_chunks_attention_and_the_output_head_come_in_pieces_with_pauses(tiny_model_dir, monkeypatch):
    """The longest stretches without a pause (a cut-in's wait) are split when a step hosts cut-ins,
    with the same results: a prompt chunk's attention over its cached context, by query rows, and
    the output head, by pieces of the vocabulary."""
    from services.engine import model as model_module
    whole = make_engine(tiny_model_dir)                          # the output head in one piece
    monkeypatch.setattr(model_module, "LOGITS_PIECE_BYTES", 128 * 64 * 4)   # 4 pieces of 128 tokens
    pieces = make_engine(tiny_model_dir)
    assert len(pieces.model.lm_head) == 4 and len(whole.model.lm_head) == 1
    # 40 queries over 5 blocks (80 keys): 10 queries per attention call.
    monkeypatch.setattr(model_module, "ATTENTION_PIECE_SCORES", 10 * 80)
    blocks = list(range(5))
    first = StepBatch([SequenceWork(1, LONG[:40], 0, blocks, GREEDY, sample=False)])
    chunk = StepBatch([SequenceWork(1, LONG[40:80], 40, blocks, GREEDY)])
    logits = {}
    for name, engine in (("whole", whole), ("pieces", pieces)):
        compute = engine.model.logits
        def capture(hidden, pause=None, name=name, compute=compute):
            logits[name] = compute(hidden, pause)
            return logits[name]
        engine.model.logits = capture
        engine.step(first)
    whole_tokens = whole.step(chunk).tokens
    pauses = []
    pieces_tokens = pieces.step(chunk, lambda: pauses.append(1)).tokens
    layers = len(pieces.model.layers)
    # between layers, after each of the 4 attention pieces of each layer, after the forward pass,
    # and between the 4 pieces of the output head
    assert len(pauses) == (layers - 1) + layers * 4 + 1 + 3
    assert pieces_tokens == whole_tokens
    assert torch.allclose(logits["pieces"], logits["whole"], atol=1e-5, rtol=0)


def test_a_cut_in_that_comes_while_the_step_it_was_sent_into_is_still_queued_runs_inside_it(tiny_model_dir):
    """The scheduler sent a step, then a cut-in into it; the worker read both before its engine
    started that step. The cut-in still runs inside the step (answered first), not after all of it."""
    service, depths = worker_with_cut_in_mid_step(tiny_model_dir)      # nothing offered by the test

    async def scheduler():
        yield plan(1, 1, LONG, list(range(8)))
        yield plan(2, 2, SHORT, [8, 9], cut_in=True)

    async def run() -> list[worker_pb2.StepResult]:
        plans, answers = asyncio.Queue(), asyncio.Queue()
        await service._read_plans(scheduler(), plans)     # both read before the engine starts
        await service._run_plans(plans, answers, asyncio.get_running_loop())
        return [answer for answer in iter(answers.get_nowait, None)]

    answers = asyncio.run(run())
    service.executor.shutdown()
    assert [a.step_id for a in answers] == [2, 1] and not any(a.error for a in answers)
    assert depths == [1, 2]                     # computed inside the other step, not after it
