"""output.HeldChunks: what a stream with an interval sends when (pure Python, times given)."""
from __future__ import annotations

from services.common.priority import LOW
from services.common.proto.qos.v1 import common_pb2
from services.common.step import SamplingParams
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.output import HeldChunks
from services.scheduler.request import Request


class Letters:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def request(interval: int, seq_id: int = 1) -> Request:
    r = Request(request_id=f"r{seq_id}", seq_id=seq_id, priority=LOW, tenant="", prompt_ids=[3, 4],
                sampling=SamplingParams(max_tokens=100), detokenizer=IncrementalDetokenizer(Letters(), [3, 4]))
    r.stream_interval = interval
    return r


def chunk(token: int, first: bool = False, last: bool = False) -> common_pb2.GenerateChunk:
    c = common_pb2.GenerateChunk(request_id="r", text=chr(ord("a") + token), token_ids=[token])
    if first:
        c.timings.ttft_ms = 5.0
    if last:
        c.finish_reason = common_pb2.FINISH_REASON_LENGTH
        c.usage.completion_tokens = 9
    return c


def test_first_alone_then_interval_sized_chunks_and_the_last_at_once():
    held, r = HeldChunks(max_hold_s=10.0), request(3)
    sent = [held.add(r, chunk(0, first=True), 0.0)]
    for t in range(1, 8):
        sent.append(held.add(r, chunk(t), t * 0.01))
    sent.append(held.add(r, chunk(8, last=True), 0.09))
    out = [c for c in sent if c is not None]
    assert [list(c.token_ids) for c in out] == [[0], [1, 2, 3], [4, 5, 6], [7, 8]]
    assert [c.text for c in out] == ["a", "bcd", "efg", "hi"]
    assert out[-1].finish_reason and out[-1].usage.completion_tokens == 9
    assert not held


def test_a_chunk_waits_no_longer_than_the_max_hold():
    held, r = HeldChunks(max_hold_s=0.5), request(100)
    assert held.add(r, chunk(1), 0.0) is None
    assert held.add(r, chunk(2), 0.3) is None
    sent = held.add(r, chunk(3), 0.5)                 # held since 0.0: due with this token
    assert list(sent.token_ids) == [1, 2, 3] and not held


def test_due_hands_over_chunks_of_streams_that_got_no_token_since():
    held, slow, busy = HeldChunks(max_hold_s=0.5), request(100, 1), request(100, 2)
    held.add(slow, chunk(1), 0.0)
    held.add(busy, chunk(7), 0.4)
    assert held.due(0.3) == []                         # not yet
    assert held.due(0.45) == []                        # looked at 0.3: next look at 0.425 is fine, none due
    due = held.due(0.6)
    assert [(r.seq_id, list(c.token_ids)) for r, c in due] == [(1, [1])]
    assert len(held) == 1 and held.take(busy).token_ids == [7] and not held
    assert held.take(busy) is None


def test_streams_are_held_apart():
    held, a, b = HeldChunks(max_hold_s=10.0), request(2, 1), request(2, 2)
    assert held.add(a, chunk(1), 0.0) is None
    assert held.add(b, chunk(5), 0.0) is None
    assert list(held.add(a, chunk(2), 0.1).token_ids) == [1, 2]
    assert list(held.add(b, chunk(6), 0.1).token_ids) == [5, 6]
