"""Bad step entries are refused with a message naming the sequence, before any tensor is touched."""
from __future__ import annotations

import pytest

from services.common.step import SequenceWork, StepBatch
from services.engine.engine import InvalidStepError
from tests.tiny_models import make_engine, reference_logits


@pytest.fixture
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir, num_blocks=40, block_size=16)  # the model's window: 512


@pytest.mark.parametrize("work, message", [
    (SequenceWork(3, [5] * 10, 505, list(range(32))), "sequence 3 would reach position 514, beyond "
                                                       "the model's context window of 512 tokens"),
    (SequenceWork(4, [5] * 40, 0, [0, 1]), "sequence 4 needs 3 KV blocks for positions 0..39 but its "
                                           "block table has 2"),
    (SequenceWork(5, [5], 40, [0, 1]), "sequence 5 needs 3 KV blocks"),
    (SequenceWork(6, [5] * 3, 0, [40]), "sequence 6 has block id 40 outside [0, 40)"),
    (SequenceWork(7, [5] * 3, 0, [-1]), "sequence 7 has block id -1"),
    (SequenceWork(8, [], 0, [0]), "sequence 8 has no tokens"),
    (SequenceWork(9, [5, 512], 0, [0]), "sequence 9 has token id 512 outside the vocabulary"),
    (SequenceWork(10, [5], -1, [0]), "sequence 10 starts at negative position"),
    (SequenceWork(11, [5] * 20, 0, [3, 3]), "sequence 11 lists the same KV block twice"),
])
def test_refused_with_clear_message(engine, work, message):
    with pytest.raises(InvalidStepError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace(".", r"\.")):
        engine.step(StepBatch([work]))


def test_duplicate_ids_and_shared_blocks_refused(engine):
    with pytest.raises(InvalidStepError, match="sequence 1 appears twice"):
        engine.step(StepBatch([SequenceWork(1, [5], 0, [0]), SequenceWork(1, [6], 0, [1])]))
    with pytest.raises(InvalidStepError, match="sequence 2 writes KV block 4, which another"):
        engine.step(StepBatch([SequenceWork(1, [5], 0, [4]), SequenceWork(2, [6], 0, [4])]))
    with pytest.raises(InvalidStepError, match="empty step"):
        engine.step(StepBatch([]))


def test_refused_step_leaves_cache_untouched(engine, tiny_reference):
    prompt = list(range(10, 60))
    engine.compute_logits(StepBatch([SequenceWork(1, prompt[:30], 0, [0, 1])]))
    # A batch whose second entry is bad must not write the first entry's tokens either.
    with pytest.raises(InvalidStepError):
        engine.step(StepBatch([SequenceWork(1, [99] * 20, 30, [0, 1, 2, 3]),
                               SequenceWork(2, [5] * 40, 0, [5])]))
    rest = engine.compute_logits(StepBatch([SequenceWork(1, prompt[30:], 30, [0, 1, 2, 3])]))[1]
    assert (rest - reference_logits(tiny_reference, prompt)[30:]).abs().max().item() < 1e-4
