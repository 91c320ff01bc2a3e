"""The continuous-batching loop: each step, plan work for every worker, run it, stream the tokens.

A step for one worker: running sequences first (decodes, then prefill chunks, oldest first), then
new admissions from the waiting queue, all within a token budget so that no step runs long.
KV blocks are allocated as tokens need them; when a worker's blocks run out, the most recently
admitted sequence is preempted (blocks freed, requeued at the front, recomputed later; its client
stream simply continues).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import grpc

from services.common.proto.qos.v1 import common_pb2, worker_pb2
from services.scheduler.kv_blocks import blocks_for_tokens
from services.scheduler.queue_policy import RequestQueue
from services.scheduler.request import Failure, Phase, Request
from services.scheduler.worker_link import WorkerLink, WorkerUnavailable

log = logging.getLogger(__name__)

FINISH_REASONS = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH}
IDLE_WAIT_SECONDS = 0.2


def engine_sampling(request: Request) -> worker_pb2.EngineSampling:
    s = request.sampling
    proto = worker_pb2.EngineSampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                      max_tokens=s.max_tokens, stop_token_ids=list(s.stop_token_ids),
                                      ignore_eos=s.ignore_eos)
    if s.seed is not None:
        proto.seed = s.seed
    return proto


class _StepBuilder:
    """Collects one worker's plan for one step."""

    def __init__(self, step_id: int, budget: int, released: list[int]):
        self.plan = worker_pb2.StepPlan(step_id=step_id, released_seq_ids=released)
        self.budget = budget
        self.scheduled: list[tuple[Request, int]] = []
        self.preempted = False   # memory ran short this step: admit nobody new

    def add(self, request: Request, num_tokens: int) -> None:
        self.plan.scheduled.append(worker_pb2.ScheduledSequence(
            seq_id=request.seq_id, num_tokens=num_tokens, new_block_ids=request.new_blocks))
        request.new_blocks = []
        self.scheduled.append((request, num_tokens))
        self.budget -= num_tokens


class ContinuousBatcher:
    def __init__(self, pool_name: str, links: list[WorkerLink], queue: RequestQueue,
                 max_running: int, max_step_tokens: int):
        self.pool_name = pool_name
        self.links = links
        self.queue = queue
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.running: dict[int, list[Request]] = {link.index: [] for link in links}
        self.to_release: dict[int, list[int]] = {link.index: [] for link in links}
        self.cancelled: set[Request] = set()
        self.wakeup = asyncio.Event()
        self.steps = 0
        self.output_tokens: Counter = Counter()
        self.preemptions = 0

    # --- called by the gRPC handlers ------------------------------------------------------------

    def submit(self, request: Request) -> None:
        self.queue.add(request)
        self.wakeup.set()

    def cancel(self, request: Request) -> None:
        """The client went away: free everything at the start of the next step."""
        if request.phase is not Phase.FINISHED:
            request.cancelled = True
            self.cancelled.add(request)
            self.wakeup.set()

    # --- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            self._reap_cancelled()
            builders = {}
            # Admit to the emptiest worker first, so load spreads across workers.
            for link in sorted(self.links, key=lambda l: -(l.pool.num_free if l.pool else -1)):
                if link.is_connected:
                    builder = self._plan(link)
                    if builder.scheduled or builder.plan.released_seq_ids:
                        builders[link.index] = builder
            if not builders:
                # Nothing to compute or release: sleep until a request arrives or is cancelled
                # (or briefly, to notice workers that reconnect).
                self.wakeup.clear()
                try:
                    await asyncio.wait_for(self.wakeup.wait(), IDLE_WAIT_SECONDS)
                except asyncio.TimeoutError:
                    pass
                continue
            self.steps += 1
            await asyncio.gather(*(self._execute(self.links[i], b) for i, b in builders.items()))

    def _plan(self, link: WorkerLink) -> _StepBuilder:
        released, self.to_release[link.index] = self.to_release[link.index], []
        builder = _StepBuilder(self.steps, self.max_step_tokens, released)
        running = self.running[link.index]
        # Decodes first (one token each, latency-critical), then prefill chunks; oldest first.
        for request in sorted(running, key=lambda r: r.pending > 1):
            if builder.budget == 0:
                break
            if request.phase is not Phase.RUNNING:
                continue  # preempted a moment ago to make room
            self._schedule(link, builder, request)
        # After a preemption, admitting would hand the victim's blocks straight back (thrashing).
        while builder.budget > 0 and len(running) < self.max_running and not builder.preempted:
            request = self.queue.peek()
            if request is None or not self._admit(link, request):
                break
            self._schedule(link, builder, request)
        # Sequences preempted while planning gave their blocks to this very plan: the worker must
        # drop them first, in the same plan.
        builder.plan.released_seq_ids.extend(self.to_release[link.index])
        self.to_release[link.index] = []
        return builder

    def _admit(self, link: WorkerLink, request: Request) -> bool:
        # Admit only when the whole known sequence (+1 for its next token) fits now, so admitted
        # prompts rarely need to preempt others to finish their prefill.
        if link.pool.num_free < blocks_for_tokens(request.num_tokens + 1, link.pool.block_size):
            return False
        self.queue.remove(request)
        request.phase = Phase.RUNNING
        request.worker = link.index
        request.computed = 0
        request.announced = False
        request.first_scheduled_at = request.first_scheduled_at or time.perf_counter()
        self.running[link.index].append(request)
        return True

    def _schedule(self, link: WorkerLink, builder: _StepBuilder, request: Request) -> None:
        pool = link.pool
        num_tokens = min(request.pending, builder.budget)
        need = blocks_for_tokens(request.computed + num_tokens, pool.block_size) - len(request.blocks)
        while need > pool.num_free:
            victim = self._newest_unscheduled(link, builder, besides=request)
            if victim is None:
                break
            self._preempt(link, victim)
            builder.preempted = True
        if need > pool.num_free:
            # Shrink the chunk to the blocks there are; with none, this request yields itself.
            num_tokens = (len(request.blocks) + pool.num_free) * pool.block_size - request.computed
            num_tokens = min(num_tokens, request.pending)
            if num_tokens <= 0:
                self._preempt(link, request)
                builder.preempted = True
                return
            need = blocks_for_tokens(request.computed + num_tokens, pool.block_size) - len(request.blocks)
        if need > 0:
            blocks = pool.allocate(request.priority, need)
            request.blocks.extend(blocks)
            request.new_blocks.extend(blocks)
        if not request.announced:
            builder.plan.new_sequences.append(worker_pb2.NewSequence(
                seq_id=request.seq_id, prompt_token_ids=request.all_ids,
                sampling=engine_sampling(request), num_generated=len(request.output_ids)))
            request.announced = True
        builder.add(request, num_tokens)

    def _newest_unscheduled(self, link: WorkerLink, builder: _StepBuilder,
                            besides: Request) -> Request | None:
        scheduled = {r for r, _ in builder.scheduled}
        for candidate in reversed(self.running[link.index]):
            if candidate is not besides and candidate not in scheduled:
                return candidate
        return None

    def _preempt(self, link: WorkerLink, request: Request) -> None:
        log.info("preempting %s (%d tokens) on worker %d", request.request_id, request.num_tokens,
                 link.index)
        self.preemptions += 1
        self._release(link, request)
        request.phase = Phase.WAITING
        self.queue.add_front(request)

    def _release(self, link: WorkerLink, request: Request) -> None:
        """Take a running request off its worker: blocks back to the pool, state dropped there."""
        if request.blocks and link.pool is not None:
            link.pool.free(request.priority, request.blocks)
        request.blocks, request.new_blocks = [], []
        request.computed = 0
        if request.announced:
            self.to_release[link.index].append(request.seq_id)
        request.announced = False
        request.worker = None
        self.running[link.index].remove(request)

    # --- after a step -------------------------------------------------------------------------

    async def _execute(self, link: WorkerLink, builder: _StepBuilder) -> None:
        try:
            result = await link.execute(builder.plan)
        except WorkerUnavailable as exc:
            self._fail_worker(link, str(exc))
            return
        except Exception as exc:   # never let one link's surprise stop the loop for everyone
            log.exception("step on worker %s failed", link.address)
            self._fail_worker(link, f"worker {link.address} failed: {exc!r}")
            return
        if result.error:
            # The worker refused the plan: a bug on our side. Fail what it carried, keep serving.
            log.error("worker %s refused step %d: %s", link.address, result.step_id, result.error)
            for request, _ in builder.scheduled:
                self._finish(request, failure=Failure(grpc.StatusCode.INTERNAL,
                                                      f"worker refused the step: {result.error}"))
            return
        for request, num_tokens in builder.scheduled:
            if request.phase is Phase.RUNNING:
                request.computed += num_tokens
        by_seq = {r.seq_id: r for r, _ in builder.scheduled}
        now = time.perf_counter()
        for token in result.tokens:
            request = by_seq.get(token.seq_id)
            if request is not None and request.phase is Phase.RUNNING and not request.cancelled:
                self._on_token(request, token, now)

    def _on_token(self, request: Request, token: worker_pb2.SampledToken, now: float) -> None:
        request.output_ids.append(token.token_id)
        self.output_tokens[request.priority] += 1
        if request.first_token_at is None:
            request.first_token_at = now
        detok = request.detokenizer
        text = detok.add(token.token_id)
        reason = "stop" if detok.stopped else token.finish_reason
        chunk = common_pb2.GenerateChunk(request_id=request.request_id, text=text,
                                         token_ids=[token.token_id], pool=self.pool_name)
        if reason:
            if not detok.stopped:
                chunk.text += detok.flush()
            chunk.finish_reason = FINISH_REASONS[reason]
            chunk.usage.CopyFrom(request.usage())
            chunk.timings.CopyFrom(request.timings(now))
            request.events.put_nowait(chunk)
            self._finish(request)
        else:
            chunk.timings.CopyFrom(request.timings())
            request.events.put_nowait(chunk)

    def _finish(self, request: Request, failure: Failure | None = None) -> None:
        if request.phase is Phase.RUNNING:
            self._release(self.links[request.worker], request)
        elif request.phase is Phase.WAITING and not request.cancelled:
            self.queue.remove(request)
        request.phase = Phase.FINISHED
        if failure is not None:
            request.events.put_nowait(failure)

    def _reap_cancelled(self) -> None:
        for request in self.cancelled:
            if request.phase is Phase.WAITING:
                self.queue.remove(request)
            elif request.phase is Phase.RUNNING:
                self._release(self.links[request.worker], request)
            request.phase = Phase.FINISHED
        self.cancelled.clear()

    def _fail_worker(self, link: WorkerLink, reason: str) -> None:
        log.error("%s; failing its %d running requests", reason, len(self.running[link.index]))
        for request in list(self.running[link.index]):
            self._release(link, request)
            request.phase = Phase.FINISHED
            request.events.put_nowait(Failure(grpc.StatusCode.UNAVAILABLE, reason))
        if not link.is_connected:   # a worker that comes back starts empty: nothing to release
            self.to_release[link.index].clear()

    # --- stats --------------------------------------------------------------------------------

    def kv_blocks_by_priority(self) -> Counter:
        held: Counter = Counter()
        for link in self.links:
            if link.pool is not None:
                held.update(link.pool.holdings())
        return held

    def running_by_priority(self) -> Counter:
        return Counter(r.priority for requests in self.running.values() for r in requests)
