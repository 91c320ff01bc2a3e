"""Streaming mode in the scheduler: plans against simulated workers that run the real worker-side
SequenceTable and keep a simulated KV cache (each computed position writes (position, token) into
its slot). A sampled token is a function of the tokens the window rule lets it attend, *read back*
from the sequence's blocks, so a block dropped too early, a block reused while still read, or a
wrong table index gives a different token: exact outputs prove the block handling right. The
workers also check every step that a streaming sequence holds no more blocks than its bound.
Pure Python (no torch)."""
from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.kv_blocks import blocks_for_tokens, cap_blocks
from services.common.priority import HIGH, LOW, MEDIUM
from services.common.proto.qos.v1 import worker_pb2
from services.common.step import FinishReason, SampledToken, SamplingParams
from services.common.stream_window import StreamWindow, kept_blocks, table_index
from services.common.wire import answer_tokens
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.policy import QoSSettings, create_policy
from services.scheduler.request import Request
from services.worker.sequences import SequenceTable
from tests.unit.test_batcher import LetterDecoder, SimulatedWorker, drain, next_token

BLOCK = 4
CHUNK = 8
WINDOW = StreamWindow(2, 10)
CAPS = {HIGH: 1.0, MEDIUM: 0.7, LOW: 0.3}
POOL_BLOCKS = 48                     # the mixed-traffic test's pool


def visible(tokens: list[int], t: int, window: StreamWindow | None) -> list[int]:
    """The positions the token at `t` attends (stream_window's rule; all before it when dense)."""
    if window is None:
        return list(range(t + 1))
    return [p for p in range(t + 1) if p < window.sink_tokens or p > t - window.window_tokens]


def expected(prompt: list[int], max_tokens: int, window: StreamWindow | None) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token([tokens[p] for p in visible(tokens, len(tokens) - 1, window)]))
    return tokens[len(prompt):]


class StreamingWorker(SimulatedWorker):
    def __init__(self, index: int, num_blocks: int):
        super().__init__(index, num_blocks)
        self.table = SequenceTable(BLOCK)
        self.kv: dict[int, tuple[int, int]] = {}
        self.most_blocks = 0           # the most one streaming sequence held, over the run
        self.dropped = 0               # blocks dropped, over the run

    async def execute(self, plan: worker_pb2.StepPlan, sent=None) -> worker_pb2.StepResult:
        if sent is not None and not sent.done():
            sent.set_result(None)
        self.dropped += sum(plan.dropped_block_counts)
        batch = self.table.apply(plan)
        tables = {seq_id: seq.block_table for seq_id, seq in self.table.sequences.items()}
        tokens = []
        for work in batch.sequences:
            dropped = work.dropped_blocks

            def slot(p: int) -> int:
                return work.block_table[table_index(p, dropped, BLOCK)] * BLOCK + p % BLOCK

            assert kept_blocks(work.end, dropped, BLOCK) <= len(work.block_table), "tokens not covered"
            if work.window is not None:
                bound = work.window.max_blocks(CHUNK, BLOCK)
                assert len(work.block_table) <= bound, f"{len(work.block_table)} blocks held, bound {bound}"
                self.most_blocks = max(self.most_blocks, len(work.block_table))
            for offset, token in enumerate(work.token_ids):
                position = work.position + offset
                block = slot(position) // BLOCK
                others = [s for s, table in tables.items() if s != work.seq_id and block in table]
                assert not others, f"block {block} written while sequences {others} hold it too"
                self.kv[slot(position)] = (position, token)
            if work.sample:
                seen = visible(list(range(work.end)), work.end - 1, work.window)
                read = [self.kv.get(slot(p)) for p in seen]
                assert all(entry is not None and entry[0] == p for p, entry in zip(seen, read)), \
                    "a position read back from a block that does not hold it"
                token = next_token([t for _, t in read])
                reason = FinishReason.LENGTH if work.num_generated + 1 >= work.sampling.max_tokens else None
                tokens.append(SampledToken(work.seq_id, token, reason))
        self.table.commit(batch, tokens)
        return answer_tokens(worker_pb2.StepResult(step_id=plan.step_id), tokens, plan.packed_results)


def request(seq_id: int, prompt: list[int], max_tokens: int, priority: int = LOW,
            window: StreamWindow | None = WINDOW) -> Request:
    return Request(request_id=f"r{seq_id}", seq_id=seq_id, priority=priority, tenant="",
                   prompt_ids=list(prompt), sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   detokenizer=IncrementalDetokenizer(LetterDecoder(), list(prompt)), window=window)


async def serve(requests: list[Request], arrivals: list[int] | None = None, num_blocks: int = 40,
                max_running: int = 6, max_step_tokens: int = 12):
    """Runs the requests (request i submitted after `arrivals[i]` steps); returns
    ({seq_id: output}, batcher, worker)."""
    policy = create_policy("qos", QoSSettings(kv_caps=dict(CAPS), high_cut_in=False))
    batcher = ContinuousBatcher("sim", [], policy, max_running, max_step_tokens)
    batcher.planner.stream_chunk = CHUNK
    worker = StreamingWorker(0, num_blocks)
    batcher.workers.add(worker)
    batcher.planner.add_worker(0)
    loop = asyncio.create_task(batcher.run())
    arrivals = arrivals or [0] * len(requests)
    try:
        for r, at in sorted(zip(requests, arrivals), key=lambda pair: pair[1]):
            while batcher.steps < at and (any(batcher.running.values())
                                          or any(policy.queue(lane) for lane in policy.lanes)):
                await asyncio.sleep(0)
            batcher.submit(r)
        results = await asyncio.wait_for(asyncio.gather(*(drain(r) for r in requests)), 20)
    finally:
        loop.cancel()
    outputs = {}
    for r, (tokens, _, last) in zip(requests, results):
        assert getattr(last, "finish_reason", None), f"{r.request_id} failed: {last}"
        outputs[r.seq_id] = tokens
    return outputs, batcher, worker


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7 + i * 13) % 90 + 5 for i in range(n)]


def test_long_prompts_stream_through_a_bounded_window():
    """Prompts many windows long, with long outputs: exact, and every sequence within its bound
    (the worker asserts it each step); blocks really were dropped and all come back at the end."""
    requests = [request(i, prompt(i, 60 + 37 * i), 30) for i in range(1, 4)]
    outputs, batcher, worker = asyncio.run(serve(requests))
    for r in requests:
        assert outputs[r.seq_id] == expected(r.prompt_ids, 30, WINDOW)
    assert worker.dropped > 0
    assert worker.most_blocks <= WINDOW.max_blocks(CHUNK, BLOCK)
    assert worker.pool.num_free == worker.pool.num_blocks


def test_dense_and_streaming_side_by_side():
    """A dense Medium request beside streaming Low ones: each with its own attention rule."""
    requests = [request(1, prompt(1, 90), 20), request(2, prompt(2, 30), 12, MEDIUM, window=None),
                request(3, prompt(3, 5), 40)]
    outputs, _, _ = asyncio.run(serve(requests))
    for r in requests:
        assert outputs[r.seq_id] == expected(r.prompt_ids, r.sampling.max_tokens, r.window)


def test_low_cap_holds_many_long_documents():
    """Low's 30% cap (12 of 40 blocks) is far less than one document's whole KV (~40 blocks)
    but holds a streaming sequence's bound: documents run, one after another, within the cap."""
    requests = [request(i, prompt(i, 150), 10) for i in range(1, 4)]
    outputs, batcher, _ = asyncio.run(serve(requests))
    assert all(outputs[r.seq_id] == expected(r.prompt_ids, 10, WINDOW) for r in requests)
    assert batcher.kv_peak[LOW] <= 12


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from([HIGH, MEDIUM, LOW]), st.integers(1, 120), st.integers(1, 25),
                          st.booleans(), st.integers(0, 30)), min_size=2, max_size=7))
def test_preemption_and_pressure_keep_outputs_exact(specs):
    """Classes mixed, streaming or dense, arriving over time on a small pool: High preempts and
    caps bind, yet every output is what the window rule gives, and no block is lost."""
    requests, arrivals = [], []
    for i, (priority, length, max_tokens, streams, at) in enumerate(specs, start=1):
        # Dense ones must fit the pool, and their class's cap as admission requires (too_large):
        # a dense Low request of 57-60 tokens needs 15 blocks, one more than Low's cap of 48 holds,
        # and once preempted could never be admitted again.
        streams = streams or length + max_tokens > 60 \
            or blocks_for_tokens(length + max_tokens, BLOCK) > cap_blocks(POOL_BLOCKS, CAPS[priority])
        requests.append(request(i, prompt(i, length), max_tokens, priority, WINDOW if streams else None))
        arrivals.append(at)
    outputs, batcher, worker = asyncio.run(serve(requests, arrivals, num_blocks=POOL_BLOCKS))
    for r in requests:
        assert outputs[r.seq_id] == expected(r.prompt_ids, r.sampling.max_tokens, r.window), r.request_id
    assert worker.pool.num_free == worker.pool.num_blocks
