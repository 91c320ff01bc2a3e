"""The scheduler's batching loop against simulated workers (pure Python, no torch, no gRPC).

The simulated worker uses the real worker-side sequence table and checks every plan the way the
engine does: the tokens computed must be covered by the sequence's blocks, and no block may be
held by two sequences. Its "model" is deterministic, so outputs can be compared across runs.
"""
from __future__ import annotations

import asyncio

import pytest

from services.common.priority import MEDIUM
from services.common.proto.qos.v1 import common_pb2, worker_pb2
from services.common.step import SampledToken, FinishReason, SamplingParams, TokenLogprobs
from services.common.errors import ErrorKind, ServiceError, unavailable
from services.common.wire import answer_tokens
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.worker_set import WorkerGone
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.common.kv_blocks import KVBlockPool, blocks_for_tokens
from services.scheduler.policy import create_policy
from services.scheduler.output import coalesce
from services.scheduler.request import Request
from services.worker.sequences import SequenceTable

BLOCK = 4


class LetterDecoder:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97 + 3


class SimulatedWorker:
    def __init__(self, index: int, num_blocks: int):
        self.index = index
        self.address = f"sim-{index}"
        self.info = worker_pb2.WorkerInfo(num_blocks=num_blocks, block_size=BLOCK, max_context=4096)
        self.adapters: frozenset[str] = frozenset()
        self.max_loras = 1 << 30
        self.pool = KVBlockPool(num_blocks, BLOCK)
        self.table = SequenceTable()
        self.answers_per_token = False      # True: a message per token, as an older worker answers
        self.plans: list[worker_pb2.StepPlan] = []
        self.fail_next = False

    @property
    def is_connected(self) -> bool:
        return self.pool is not None

    async def close(self) -> None:
        self.pool = None

    def hold_off(self, seconds: float) -> None:
        self.held_off = seconds

    def restart(self) -> None:
        """Back after a crash: a fresh cache, no sequences (as a restarted worker process)."""
        self.pool = KVBlockPool(self.info.num_blocks, BLOCK)
        self.table = SequenceTable()
        self.fail_next = False

    async def execute(self, plan: worker_pb2.StepPlan, sent=None) -> worker_pb2.StepResult:
        if sent is not None and not sent.done():     # on its way at once
            sent.set_result(None)
        if self.fail_next or self.pool is None:
            self.pool = None
            raise WorkerGone(f"worker {self.address} failed: killed")
        self.plans.append(plan)
        batch = self.table.apply(plan)
        owners: dict[int, int] = {}
        for seq in self.table.sequences.values():
            for block in seq.block_table:
                assert owners.setdefault(block, id(seq)) == id(seq), "a block shared by two sequences"
        tokens = []
        for work in batch.sequences:
            assert blocks_for_tokens(work.end, BLOCK) <= len(work.block_table), "tokens not covered by blocks"
            if work.sample:
                seq = self.table.sequences[work.seq_id]
                token = next_token(seq.tokens[:work.end])
                generated = work.num_generated + 1
                reason = FinishReason.LENGTH if generated >= work.sampling.max_tokens else None
                tokens.append(SampledToken(work.seq_id, token, reason, position_logprobs(work)))
        self.table.commit(batch, tokens)
        return answer_tokens(worker_pb2.StepResult(step_id=plan.step_id), tokens,
                             plan.packed_results and not self.answers_per_token)


def position_logprobs(work) -> TokenLogprobs | None:
    """For a sequence that asks: a logprob that names the position its token was sampled at."""
    return None if work.sampling.logprobs is None else TokenLogprobs(-work.end / 8)


def make_request(seq_id: int, prompt_len: int, max_tokens: int, stop=()) -> Request:
    prompt = [(seq_id * 7 + i) % 50 + 3 for i in range(prompt_len)]
    return Request(request_id=f"r{seq_id}", seq_id=seq_id, priority=MEDIUM,
                   tenant="", prompt_ids=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   detokenizer=IncrementalDetokenizer(LetterDecoder(), prompt, stop=list(stop)))


async def drain(request: Request) -> tuple[list[int], str, object]:
    tokens, text = [], ""
    while True:
        event = await request.events.get()
        if isinstance(event, ServiceError):
            return tokens, text, event
        tokens.extend(event.token_ids)
        text += event.text
        if event.finish_reason:
            return tokens, text, event


async def serve(requests, num_blocks=64, max_running=8, max_step_tokens=16, workers=1, adapters=(),
                max_loras=1 << 30, answers_per_token=False, links=None):
    """`links`: workers made by the caller (e.g. a misbehaving one), instead of `workers` simulated ones."""
    links = links or [SimulatedWorker(i, num_blocks) for i in range(workers)]
    for link in links:
        link.adapters, link.max_loras = frozenset(adapters), max_loras
        link.answers_per_token = answers_per_token
    batcher = ContinuousBatcher("sim", links, create_policy("fcfs"), max_running, max_step_tokens)
    loop = asyncio.create_task(batcher.run())
    for request in requests:
        batcher.submit(request)
    try:
        results = await asyncio.wait_for(asyncio.gather(*(drain(r) for r in requests)), 10)
    finally:
        loop.cancel()
    return results, batcher, links


def expected_output(request: Request) -> list[int]:
    tokens = list(request.prompt_ids)
    for _ in range(request.sampling.max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(request.prompt_ids):]


@pytest.mark.parametrize("answers_per_token", [False, True], ids=["packed", "older-worker"])
def test_chunked_prefill_respects_the_step_budget_and_outputs_are_exact(answers_per_token):
    # Also the answers of an older worker, a message per token (StepResult.tokens), read the same.
    requests = [make_request(i, prompt_len=10 + 9 * i, max_tokens=5) for i in range(6)]
    results, batcher, (worker,) = asyncio.run(serve(requests, max_step_tokens=16,
                                                    answers_per_token=answers_per_token))
    for request, (tokens, _, last) in zip(requests, results):
        assert tokens == expected_output(request)
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 5
    assert all(sum(plan.scheduled_num_tokens) <= 16 for plan in worker.plans)
    assert worker.pool.num_used == 0 and not worker.table.sequences


def test_preemption_when_blocks_run_out_keeps_streams_exact():
    # 12 blocks of 4 tokens: four 10-token prompts growing to 30 tokens cannot all fit at once.
    requests = [make_request(i, prompt_len=10, max_tokens=20) for i in range(4)]
    results, batcher, (worker,) = asyncio.run(serve(requests, num_blocks=12, max_step_tokens=64))
    assert batcher.preemptions > 0
    for request, (tokens, text, last) in zip(requests, results):
        assert tokens == expected_output(request)                 # no gap, no duplicate
        assert text == LetterDecoder().decode(tokens)
    assert worker.pool.num_used == 0


def test_stop_string_finishes_and_releases_on_the_worker():
    probe = make_request(1, prompt_len=6, max_tokens=12)
    text = LetterDecoder().decode(expected_output(probe))
    stop = text[5:7]
    request = make_request(1, prompt_len=6, max_tokens=12, stop=[stop])
    ((tokens, streamed, last),), batcher, (worker,) = asyncio.run(serve([request]))
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert streamed == text[:text.index(stop)]
    assert worker.pool.num_used == 0


async def three_streaming(worker: SimulatedWorker):
    """A running batcher loop with three long requests that have each streamed a token."""
    batcher = ContinuousBatcher("sim", [worker], create_policy("fcfs"), 8, 16)
    loop = asyncio.create_task(batcher.run())
    requests = [make_request(i, prompt_len=8, max_tokens=1000) for i in range(3)]
    for r in requests:
        batcher.submit(r)
    for r in requests:
        await r.events.get()
    return batcher, loop, requests


def test_cancellation_frees_blocks_and_tells_the_worker():
    async def scenario():
        worker = SimulatedWorker(0, 64)
        batcher, loop, requests = await three_streaming(worker)
        for r in requests:
            batcher.cancel(r)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not worker.table.sequences:
                break
        loop.cancel()
        return worker

    worker = asyncio.run(scenario())
    assert worker.pool.num_used == 0
    assert not worker.table.sequences


def test_requests_spread_over_two_workers():
    requests = [make_request(i, prompt_len=12, max_tokens=4) for i in range(8)]
    results, _, workers = asyncio.run(serve(requests, workers=2, max_running=4))
    assert all(tokens == expected_output(r) for r, (tokens, _, _) in zip(requests, results))
    assert all(any(p.new_sequences for p in w.plans) for w in workers)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown scheduling policy 'lottery'"):
        create_policy("lottery")


def test_the_first_chunk_tells_prompt_size_and_ttft_the_last_everything_and_the_rest_only_tokens():
    request = make_request(1, prompt_len=5, max_tokens=4)
    chunks = []

    async def run():      # stepped by hand, so that every chunk is seen as it was put
        links = [SimulatedWorker(0, 64)]
        batcher = ContinuousBatcher("sim", links, create_policy("fcfs"), 8, 16)
        batcher.submit(request)
        for _ in range(20):          # prompt, 4 tokens: a few steps; bounded, never a hang
            if len(chunks) == 4:
                break
            await batcher.step()
            while not request.events.empty():
                chunks.append(request.events.get_nowait())

    asyncio.run(run())
    first, *middle, last = chunks
    assert first.usage.prompt_tokens == 5 and first.HasField("timings") and first.timings.ttft_ms > 0
    assert first.timings.e2e_ms == 0
    assert middle and all(not c.HasField("timings") and not c.HasField("usage") for c in middle)
    assert all(len(c.token_ids) == 1 for c in chunks)
    assert last.finish_reason and last.usage.completion_tokens == 4 and last.timings.e2e_ms > 0
    assert last.timings.ttft_ms == first.timings.ttft_ms


class CountingDetokenizer(IncrementalDetokenizer):
    """Counts the tokens it is given."""
    added = 0

    def add(self, token_id: int) -> str:
        self.added += 1
        return super().add(token_id)


class StreamWatchingWorker(SimulatedWorker):
    """Notes, as each plan arrives, how many of the watched request's tokens the scheduler has
    taken and how many have reached its stream (nobody reads the stream meanwhile). It answers
    after a moment, as a worker across a connection does, not within the call."""

    def __init__(self, index: int, num_blocks: int, watched: Request):
        super().__init__(index, num_blocks)
        self.watched = watched
        self.seen: list[tuple[int, int]] = []
        self.detokenized: list[int] = []       # tokens its detokenizer had taken, at each plan

    async def execute(self, plan, sent=None):
        self.seen.append((len(self.watched.output_ids), self.watched.events.qsize()))
        self.detokenized.append(getattr(self.watched.detokenizer, "added", -1))
        if sent is not None:
            sent.set_result(None)
        await asyncio.sleep(0.002)
        return await super().execute(plan)


def looping(worker: SimulatedWorker, request: Request) -> tuple[ContinuousBatcher, asyncio.Task]:
    """A batcher over `worker` running its loop (FCFS, 8 running, 16-token steps), `request` in."""
    batcher = ContinuousBatcher("sim", [worker], create_policy("fcfs"), 8, 16)
    loop = asyncio.create_task(batcher.run())
    batcher.submit(request)
    return batcher, loop


def test_in_the_loop_the_next_plan_goes_out_before_the_last_steps_tokens_reach_their_streams():
    request = make_request(1, prompt_len=5, max_tokens=6)
    request.detokenizer = CountingDetokenizer(LetterDecoder(), request.prompt_ids)

    async def go():
        worker = StreamWatchingWorker(0, 64, request)
        batcher, loop = looping(worker, request)
        try:
            for _ in range(500):                  # the stream is read only at the end
                if request.finished_at is not None:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)             # the last chunk goes out once the loop is idle
            return worker, await asyncio.wait_for(drain(request), 5)
        finally:
            loop.cancel()

    worker, (tokens, _, final) = asyncio.run(go())
    # Each plan after the first token found that token taken but not yet streamed, not even
    # detokenized: its text and chunk are made, and the stream handlers wake, only once the plan
    # is on its way (ContinuousBatcher.execute).
    decoding = [(taken, streamed) for taken, streamed in worker.seen if taken]
    assert decoding and all(streamed == taken - 1 for taken, streamed in decoding)
    assert all(detokenized == taken - 1 for (taken, _), detokenized in zip(worker.seen, worker.detokenized) if taken)
    # ... and nothing is lost or reordered for it, the last token and its final chunk included.
    assert tokens == expected_output(request) and final.finish_reason


def test_a_stop_string_found_after_the_next_plan_went_out_costs_one_dropped_token():
    """In the loop a token's text is made after the next plan is sent, so the plan that follows
    the stop string's last token schedules the request once more: that token is computed, never
    streamed nor counted, and the next step releases the sequence on the worker."""
    probe = make_request(1, prompt_len=6, max_tokens=12)
    text = LetterDecoder().decode(expected_output(probe))
    stop = text[5:7]                       # ends with the 7th token
    request = make_request(1, prompt_len=6, max_tokens=12, stop=[stop])

    async def go():
        worker = StreamWatchingWorker(0, 64, request)
        batcher, loop = looping(worker, request)
        try:
            result = await asyncio.wait_for(drain(request), 5)
            for _ in range(200):                   # the release goes out with the next step
                if not worker.table.sequences:
                    break
                await asyncio.sleep(0.01)
            return worker, batcher, result
        finally:
            loop.cancel()

    worker, batcher, (tokens, streamed, last) = asyncio.run(go())
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert streamed == text[:text.index(stop)] and tokens == expected_output(probe)[:7]
    assert last.usage.completion_tokens == 7 and request.output_ids == tokens
    scheduled = [plan for plan in worker.plans if request.seq_id in plan.scheduled_seq_ids]
    assert len(scheduled) == 1 + 7                 # the prompt, 6 decodes, and the one dropped
    assert any(request.seq_id in plan.released_seq_ids for plan in worker.plans)
    assert not worker.table.sequences and worker.pool.num_used == 0 and batcher.finished == 1


def test_queued_chunks_are_coalesced_without_losing_anything():
    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        for i, text in enumerate(["a", "b", "c"]):
            queue.put_nowait(common_pb2.GenerateChunk(text=text, token_ids=[i]))
        last = common_pb2.GenerateChunk(text="d", token_ids=[3], finish_reason=common_pb2.FINISH_REASON_STOP)
        last.usage.completion_tokens = 4
        queue.put_nowait(last)
        queue.put_nowait(ServiceError(ErrorKind.INTERNAL, "never read after the final chunk"))
        merged, failure = coalesce(await queue.get(), queue)
        assert failure is None
        return merged, queue.qsize()

    merged, left = asyncio.run(scenario())
    assert (merged.text, list(merged.token_ids)) == ("abcd", [0, 1, 2, 3])
    assert merged.finish_reason == common_pb2.FINISH_REASON_STOP and merged.usage.completion_tokens == 4
    assert left == 1


def test_a_failure_is_not_merged_into_a_chunk():
    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(common_pb2.GenerateChunk(text="a", token_ids=[1]))
        queue.put_nowait(unavailable("worker failed"))
        first, failure = coalesce(await queue.get(), queue)
        again, nothing = coalesce(failure, queue)
        return first, failure, again, nothing, queue.qsize()

    first, failure, again, nothing, left = asyncio.run(scenario())
    assert first.text == "a" and isinstance(failure, ServiceError)
    assert again is failure and nothing is None and left == 0


def test_lora_requests_stay_within_max_loras_and_only_go_where_the_adapter_is():
    requests = [make_request(i, prompt_len=6, max_tokens=4) for i in range(6)]
    for i, request in enumerate(requests):
        request.lora = ("a", "b", "c")[i % 3]
    results, batcher, (worker,) = asyncio.run(serve(requests, adapters={"a", "b", "c"}, max_loras=2))
    assert all(tokens == expected_output(r) for r, (tokens, _, _) in zip(requests, results))
    by_seq = {r.seq_id: r.lora for r in requests}
    assert all(len({by_seq[s] for s in plan.scheduled_seq_ids}) <= 2 for plan in worker.plans)
    assert {n.lora for plan in worker.plans for n in plan.new_sequences} == {"a", "b", "c"}


def test_a_worker_without_the_adapter_is_never_given_it():
    async def two_workers():
        links = [SimulatedWorker(0, 64), SimulatedWorker(1, 64)]
        links[0].adapters, links[1].adapters = frozenset({"a"}), frozenset({"a", "b"})
        batcher = ContinuousBatcher("sim", links, create_policy("fcfs"), 8, 16)
        loop = asyncio.create_task(batcher.run())
        requests = [make_request(i, prompt_len=6, max_tokens=3) for i in range(8)]
        for i, request in enumerate(requests):
            request.lora = "b" if i % 2 else "a"
            batcher.submit(request)
        try:
            results = await asyncio.wait_for(asyncio.gather(*(drain(r) for r in requests)), 10)
        finally:
            loop.cancel()
        return requests, results, links

    requests, results, links = asyncio.run(two_workers())
    assert all(tokens == expected_output(r) for r, (tokens, _, _) in zip(requests, results))
    assert "b" not in {n.lora for plan in links[0].plans for n in plan.new_sequences}


class HeldWorker(SimulatedWorker):
    """Answers a step only once `release` is set: a step in flight for as long as a test needs."""

    def __init__(self, index: int, num_blocks: int):
        super().__init__(index, num_blocks)
        self.release = asyncio.Event()
        self.release.set()
        self.in_step = asyncio.Event()

    async def execute(self, plan, sent=None):
        self.in_step.set()
        if sent is not None:
            sent.set_result(None)
        await self.release.wait()
        return await super().execute(plan)


def test_a_worker_that_leaves_while_its_step_runs_stops_nothing():
    """Membership removes a worker (gone from DNS) while a step on it is in flight: its
    sequences move to the other worker, its late answer is dropped, the loop goes on."""
    async def go():
        leaving, staying = HeldWorker(0, 64), SimulatedWorker(1, 64)
        batcher = ContinuousBatcher("sim", [leaving, staying], create_policy("fcfs"), 8, 16)
        loop = asyncio.create_task(batcher.run())
        requests = [make_request(i, prompt_len=6, max_tokens=6) for i in range(4)]
        for request in requests:
            batcher.submit(request)
        await asyncio.wait_for(leaving.in_step.wait(), 5)
        leaving.release.clear()                       # the next step on it hangs in flight
        leaving.in_step.clear()
        await asyncio.wait_for(leaving.in_step.wait(), 5)
        batcher.remove_link(leaving, "worker sim-0 left the pool (test)")
        await leaving.close()                         # as membership.leave does: the call breaks
        leaving.release.set()
        try:
            return requests, await asyncio.wait_for(asyncio.gather(*(drain(r) for r in requests)), 10), loop
        finally:
            loop.cancel()

    requests, results, loop = asyncio.run(go())
    assert all(tokens == expected_output(r) for r, (tokens, _, _) in zip(requests, results))


class UnwrittenWorker(SimulatedWorker):
    """A worker whose stream takes the plans but never reports one written (flow control, a
    stalled connection); from the second step on it answers only when the test lets it."""

    def __init__(self, index: int, num_blocks: int):
        super().__init__(index, num_blocks)
        self.release = asyncio.Event()
        self.in_second_step = asyncio.Event()
        self.calls = 0

    async def execute(self, plan, sent=None):
        self.calls += 1
        if self.calls >= 2:
            self.in_second_step.set()
            await self.release.wait()
        return await super().execute(plan)


def test_a_plan_never_written_does_not_hold_up_the_streams():
    """The loop waits for the plans to be written before it streams the last step's tokens, but
    not for long: while the worker's plan sits unwritten, the token of the step before still
    reaches its stream."""
    async def go():
        stuck = UnwrittenWorker(0, 64)
        request = make_request(1, prompt_len=4, max_tokens=6)
        _, loop = looping(stuck, request)
        try:
            await asyncio.wait_for(stuck.in_second_step.wait(), 5)
            first = await asyncio.wait_for(request.events.get(), 5)   # the prompt step's token
            in_flight = not stuck.release.is_set()
            stuck.release.set()
            return request, first, in_flight, await asyncio.wait_for(drain(request), 5)
        finally:
            loop.cancel()

    request, first, in_flight, (tokens, _, last) = asyncio.run(go())
    assert in_flight and list(first.token_ids) == expected_output(request)[:1]
    assert list(first.token_ids) + tokens == expected_output(request) and last.finish_reason


class LongStepWorker(SimulatedWorker):
    """Computes each ordinary step at once but answers it only when `release` is set (a long step
    in flight); cut-ins run and are answered meanwhile, as a real worker runs them between the
    layers of the step in flight."""

    def __init__(self, index: int, num_blocks: int):
        super().__init__(index, num_blocks)
        self.computing = asyncio.Event()
        self.release = asyncio.Event()

    async def execute(self, plan, sent=None):
        result = await super().execute(plan, sent)
        if plan.scheduled_seq_ids and not plan.cut_in:
            self.computing.set()
            await self.release.wait()
        return result


def make_classed_request(seq_id: int, priority: int, prompt_len: int, max_tokens: int) -> Request:
    request = make_request(seq_id, prompt_len, max_tokens)
    request.priority = priority
    return request


def qos_loop_with(worker, first: Request, **settings) -> tuple[ContinuousBatcher, asyncio.Task]:
    """A QoS batcher on `worker` (8 running, 16-token steps) with `first` submitted and its loop
    started (inside the running event loop)."""
    from services.scheduler.policy import QoSSettings
    batcher = ContinuousBatcher("sim", [worker], create_policy("qos", QoSSettings(**settings)), max_running=8,
                                max_step_tokens=16)
    batcher.submit(first)
    return batcher, asyncio.create_task(batcher.run())


@pytest.mark.parametrize("cut_in", [True, False])
def test_a_high_request_arriving_mid_step_gets_its_first_token_inside_that_step(cut_in):
    from services.common.priority import HIGH, LOW

    async def main():
        worker = LongStepWorker(0, 256)
        low = make_classed_request(1, LOW, prompt_len=40, max_tokens=4)
        batcher, loop = qos_loop_with(worker, low, high_cut_in=cut_in)
        try:
            await asyncio.wait_for(worker.computing.wait(), 5)     # Low's first chunk in flight
            high = make_classed_request(2, HIGH, prompt_len=10, max_tokens=3)
            batcher.submit(high)
            first = asyncio.ensure_future(high.events.get())
            await asyncio.sleep(0.05)
            cut_ins = [p for p in worker.plans if p.cut_in]
            if not cut_in:
                assert not cut_ins and not first.done()              # it waits for the step in flight
            else:
                assert [list(p.scheduled_seq_ids) for p in cut_ins] == [[2]]
                assert first.done() and first.result().token_ids == expected_output(high)[:1]
                assert batcher.cut_ins.steps == 1
            worker.release.set()
            rest = await asyncio.wait_for(asyncio.gather(drain(low), drain(high)), 5)
        finally:
            loop.cancel()
        tokens = list(first.result().token_ids) + rest[1][0]
        assert rest[0][0] == expected_output(low) and tokens == expected_output(high)

    asyncio.run(main())



class SlowCutInWorker(LongStepWorker):
    """A LongStepWorker whose cut-ins, too, are answered only when the test lets them
    (`cut_in_release`): cut-ins still computing after the step they were sent into was answered."""

    def __init__(self, index: int, num_blocks: int):
        super().__init__(index, num_blocks)
        self.cut_in_release = asyncio.Event()

    async def execute(self, plan, sent=None):
        result = await super().execute(plan, sent)
        if plan.cut_in:
            await self.cut_in_release.wait()
        return result


def test_a_high_request_arriving_while_cut_ins_finish_cuts_in_too_up_to_a_step_budget():
    """The step in flight was answered, but a cut-in sent into it still computes: the next plan
    waits for that cut-in. A High request arriving then goes as a cut-in of its own (the worker
    runs it right after, alone) rather than waiting for the next plan with every running decode;
    up to one step's token budget of such cut-ins (16 here: one 10-token prompt) between two
    steps, so High arrivals cannot hold the next plan back for long."""
    from services.common.priority import HIGH, LOW

    async def main():
        worker = SlowCutInWorker(0, 256)
        low = make_classed_request(1, LOW, prompt_len=40, max_tokens=4)
        batcher, loop = qos_loop_with(worker, low)
        try:
            await asyncio.wait_for(worker.computing.wait(), 5)     # Low's first chunk in flight
            highs = [make_classed_request(seq_id, HIGH, prompt_len=10, max_tokens=3) for seq_id in (2, 3, 4)]
            batcher.submit(highs[0])                                # cuts into Low's step
            await asyncio.sleep(0.05)
            worker.release.set()                                    # Low's step answered ...
            await asyncio.sleep(0.05)                               # ... the cut-in still computing
            batcher.submit(highs[1])
            batcher.submit(highs[2])
            await asyncio.sleep(0.05)
            cut_ins = [list(p.scheduled_seq_ids) for p in worker.plans if p.cut_in]
            steps_before = sum(1 for p in worker.plans if not p.cut_in)
            worker.cut_in_release.set()
            results = await asyncio.wait_for(asyncio.gather(drain(low), *(drain(h) for h in highs)), 5)
        finally:
            loop.cancel()
        assert cut_ins == [[2], [3]] and steps_before == 1
        assert [r[0] for r in results] == [expected_output(r) for r in [low] + highs]

    asyncio.run(main())


def test_a_step_that_serves_first_tokens_takes_no_cut_in():
    """A High request arriving while a step computes another High request's first token waits
    for that step: cut into it, it would hold back the first token it carries."""
    from services.common.priority import HIGH

    async def main():
        worker = LongStepWorker(0, 256)
        first = make_classed_request(1, HIGH, prompt_len=10, max_tokens=2)
        batcher, loop = qos_loop_with(worker, first)
        try:
            await asyncio.wait_for(worker.computing.wait(), 5)       # its first-token step in flight
            second = make_classed_request(2, HIGH, prompt_len=10, max_tokens=2)
            batcher.submit(second)
            await asyncio.sleep(0.05)
            assert batcher.cut_ins.steps == 0 and not [p for p in worker.plans if p.cut_in]
            worker.release.set()
            results = await asyncio.wait_for(asyncio.gather(drain(first), drain(second)), 5)
        finally:
            loop.cancel()
        assert [r[0] for r in results] == [expected_output(first), expected_output(second)]

    asyncio.run(main())


# --- stream intervals: several tokens a chunk (output.HeldChunks) ---------------------------------

async def chunk_sizes(request: Request) -> tuple[list[int], list[int], object]:
    """Tokens per event of the stream as the batcher put them (no coalescing), all its tokens,
    and the last event (the final chunk or a failure)."""
    sizes, tokens = [], []
    while True:
        event = await request.events.get()
        if isinstance(event, ServiceError):
            return sizes, tokens, event
        sizes.append(len(event.token_ids))
        tokens.extend(event.token_ids)
        if event.finish_reason:
            return sizes, tokens, event


def test_a_stream_with_an_interval_sends_its_first_token_alone_then_that_many_a_chunk():
    request = make_request(1, prompt_len=6, max_tokens=11)
    request.stream_interval = 4
    plain = make_request(2, prompt_len=6, max_tokens=5)

    async def go():
        batcher = ContinuousBatcher("sim", [SimulatedWorker(0, 64)], create_policy("fcfs"), 8, 16)
        loop = asyncio.create_task(batcher.run())
        for r in (request, plain):
            batcher.submit(r)
        try:
            return await asyncio.wait_for(asyncio.gather(chunk_sizes(request), chunk_sizes(plain)), 10), batcher
        finally:
            loop.cancel()

    ((sizes, tokens, last), (plain_sizes, _, _)), batcher = asyncio.run(go())
    assert sizes == [1, 4, 4, 2]                       # the first alone (its TTFT), the last at once
    assert tokens == expected_output(request) and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 11
    assert plain_sizes == [1] * 5                      # interval 1: a chunk per token, as before
    assert not batcher.streams.held_chunks


def test_tokens_held_for_an_interval_reach_the_client_before_a_failure():
    """The only worker dies and none comes back: the request is handed back with UNAVAILABLE,
    and every token the scheduler had taken reaches the stream first (the router resumes the
    request elsewhere after exactly the tokens its client has)."""
    request = make_request(1, prompt_len=6, max_tokens=40)
    request.stream_interval = 1000

    async def go():
        worker = SimulatedWorker(0, 64)
        batcher = ContinuousBatcher("sim", [worker], create_policy("fcfs"), 8, 16, orphan_grace_s=0.05)
        loop = asyncio.create_task(batcher.run())
        batcher.submit(request)
        while len(request.output_ids) < 6:
            await asyncio.sleep(0.001)
        worker.fail_next = True
        try:
            return await asyncio.wait_for(chunk_sizes(request), 10), batcher
        finally:
            loop.cancel()

    (sizes, tokens, last), batcher = asyncio.run(go())
    assert isinstance(last, ServiceError) and last.kind is ErrorKind.UNAVAILABLE
    assert sizes[0] == 1 and len(sizes) == 2          # the first token, then all the held ones
    assert tokens == request.output_ids == expected_output(request)[:len(tokens)]
    assert len(tokens) >= 6 and not batcher.streams.held_chunks


def test_a_cancelled_stream_leaves_nothing_held():
    async def go():
        request = make_request(1, prompt_len=6, max_tokens=1000)
        request.stream_interval = 1000
        batcher, loop = looping(SimulatedWorker(0, 64), request)
        while len(request.output_ids) < 4:
            await asyncio.sleep(0.001)
        held = len(batcher.streams.held_chunks)
        batcher.cancel(request)
        loop.cancel()
        return held, batcher

    held, batcher = asyncio.run(go())
    assert held == 1 and not batcher.streams.held_chunks


@pytest.mark.parametrize("slots", [0.125, 0.0])
def test_a_high_request_cuts_in_while_every_running_slot_is_taken(slots):
    """A cut-in cannot preempt (every sequence may be in the step in flight), so it takes one of a
    few slots beyond max_running (high_cut_in_slots, at least one while > 0): under a burst every
    slot is taken, and High would wait for the step in flight. No other class gets in meanwhile.
    With no slots beyond max_running (0), it waits, and every stream still gets its exact output."""
    from services.common.priority import HIGH, LOW

    async def main():
        worker = LongStepWorker(0, 256)
        lows = [make_classed_request(seq_id, LOW, prompt_len=2, max_tokens=6) for seq_id in range(1, 10)]
        batcher, loop = qos_loop_with(worker, lows[0], high_cut_in_slots=slots)
        for low in lows[1:]:
            batcher.submit(low)
        try:
            await asyncio.wait_for(worker.computing.wait(), 5)     # 8 Low running (the max), one waiting
            assert len(batcher.running[0]) == 8
            highs = [make_classed_request(seq_id, HIGH, prompt_len=4, max_tokens=3) for seq_id in (20, 21)]
            for high in highs:
                batcher.submit(high)
            await asyncio.sleep(0.05)
            cut_ins = [list(p.scheduled_seq_ids) for p in worker.plans if p.cut_in]
            running = len(batcher.running[0])
            worker.release.set()
            results = await asyncio.wait_for(asyncio.gather(*(drain(r) for r in lows + highs)), 5)
        finally:
            loop.cancel()
        if slots:
            assert cut_ins == [[20]] and running == 9       # one slot beyond 8; the second High waits
        else:
            assert cut_ins == [] and running == 8
        assert [r[0] for r in results] == [expected_output(r) for r in lows + highs]

    asyncio.run(main())
