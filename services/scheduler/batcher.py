"""The continuous-batching loop. Start reading at `step()`: plan a step for every worker with
work (services/scheduler/planner.py), execute the plans on the workers, postprocess their sampled
tokens into the clients' streams (services/scheduler/output.py). `run()` repeats it forever.

Pure Python with no gRPC: a failure reaches a client stream as a ServiceError on its event queue;
the Submit handler maps it to a status at the edge.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from typing import Callable

from services.common.errors import ErrorKind, ServiceError
from services.common.kv_blocks import KVBlockPool
from services.common.priority import HIGH
from services.common.proto.qos.v1 import worker_pb2
from services.common.step import FinishReason
from services.common.wire import finish_reason, sampled_seq_ids
from services.scheduler.announcement import prompt_announcement
from services.scheduler.answer_check import answer_mismatch
from services.scheduler.cut_in_dispatch import CutInDispatch
from services.scheduler.failover import WorkerChanges
from services.scheduler.monitor import ResourceMonitor
from services.scheduler.output import grammar_dead_end
from services.scheduler.planner import StepBuilder, StepPlanner
from services.scheduler.policy import SchedulingPolicy
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.request import Phase, Request
from services.scheduler.step_builder import charge_decodes
from services.scheduler.step_totals import StepTotals, estimated_wait_ms
from services.scheduler.stream_out import SampledText, StreamOut
from services.scheduler.worker_set import Worker, WorkerGone, WorkerSet

log = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 0.2
STEP_TIMEOUT_SECONDS = 30.0      # a worker that takes longer to answer one step counts as gone
ORPHAN_GRACE_SECONDS = 10.0      # with no worker to serve, how long requests wait for one to (re)join
STREAM_MAX_HOLD_SECONDS = 0.5    # longest a chunk waits for the rest of its stream interval
PLAN_WRITE_WAIT_SECONDS = 0.05   # the most the loop waits for plans to be written before streaming


class ContinuousBatcher(WorkerChanges):
    def __init__(self, pool_name: str, links: list[Worker], policy: SchedulingPolicy,
                 max_running: int, max_step_tokens: int, monitor: ResourceMonitor | None = None,
                 orphan_grace_s: float = ORPHAN_GRACE_SECONDS,
                 step_timeout_s: float = STEP_TIMEOUT_SECONDS,
                 stream_max_hold_s: float = STREAM_MAX_HOLD_SECONDS,
                 prefix_cache: PrefixCache | None = None, clock: Callable[[], float] = time.perf_counter):
        self.pool_name = pool_name
        # The clock of the policy's window of shares (QoSPolicy.backlog_changed): a simulator's
        # virtual one in bench/sim, so that its scheduling does not depend on how fast the host is.
        self.clock = clock
        self.workers = WorkerSet(links)
        self.policy = policy
        self.monitor = monitor
        # Prefix caching (prefix_cache.py): pools from make_pool; placement follows the cache.
        self.prefix_cache = prefix_cache
        self.make_pool = prefix_cache.make_pool if prefix_cache is not None else lambda n, b, *_: KVBlockPool(n, b)
        self.planner = StepPlanner(policy, max_running, max_step_tokens, prefix_cache)
        if prefix_cache is not None:
            self.planner.may_place = prefix_cache.placer(self.workers, self.planner, lambda: self.steps)
        for link in links:
            self.watch(link)
        self.orphan_grace_s = orphan_grace_s
        self.step_timeout_s = step_timeout_s
        self.cancelled: set[Request] = set()
        # Tokens into the clients' streams (stream_out.py), held while the next plans are sent.
        self.streams = StreamOut(pool_name, stream_max_hold_s, self._completed)
        self.wakeup = asyncio.Event()
        self.steps = 0
        self.output_tokens: Counter = Counter()
        self.prompt_tokens: Counter = Counter()     # prompts whose first token came, by class
        self.kv_peak: Counter = Counter()           # most blocks each class held on one worker
        self.failovers: Counter = Counter()         # sequences moved off a worker, by reason
        self.quarantines: Counter = Counter()       # address -> answers that did not match plans
        self.totals = StepTotals()                  # for the router's latency model (step_totals.py)
        self.finished = 0                           # requests completed since start
        self.recent_ttft_ms: deque[float] = deque(maxlen=200)
        # Completed, with why (metrics): (request, when, FinishReason)
        self.on_finished: Callable[[Request, float, FinishReason], None] | None = None
        # In run() (or a caller that does as run() does, bench/scheduler_overhead.py): the last
        # worker to answer a step has its tokens' text, chunks and failures held back until the
        # next step's plans are on their way (execute() releases them: stream_out.py).
        self.hold_streams = False
        self._answers_pending = 0
        # High requests sent into the steps workers compute (policy.cut_in; cut_in_dispatch.py).
        self.cut_ins = CutInDispatch(self.planner, self.workers, self._run_cut_in, self._next_step_id)
        # Of each plan made last, what settle_plans still has to do with: its decodes by lane, not
        # yet charged to their tenants (StepBuilder.decodes_by_lane), and its worker's block pool.
        # Not the plans: they go with their step.
        self._unsettled: list[tuple[dict[int, list[list[Request]]], KVBlockPool | None]] = []

    @property
    def links(self) -> list[Worker]:
        return list(self.workers)

    @property
    def running(self) -> dict[int, list[Request]]:
        return self.planner.running

    @property
    def served_tokens(self) -> Counter:
        return self.planner.served_tokens

    @property
    def preempted_by_priority(self) -> Counter:
        return self.planner.preempted_by_priority

    @property
    def preemptions(self) -> int:
        return sum(self.preempted_by_priority.values())

    # --- called by the Submit handler -----------------------------------------------------------

    def submit(self, request: Request) -> None:
        prompt_announcement(request)        # its prompt made into protobuf here, not in a step's plan
        self.policy.add(request)
        if request.priority == HIGH and self.policy.cut_in:
            self.cut_ins.dispatch()
        self.wakeup.set()

    def cancel(self, request: Request) -> None:
        """The client went away: free everything at the start of the next step."""
        self.streams.forget(request)
        if request.phase is not Phase.FINISHED:
            request.cancelled = True
            self.cancelled.add(request)
            self.wakeup.set()

    # --- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        self.hold_streams = True
        while True:
            try:
                stepped = await self.step()
            except Exception:        # a bug in one step must not stop every stream of the pool
                log.exception("pool %s: a step failed; the loop goes on", self.pool_name)
                self.release_streams()
                await asyncio.sleep(0.1)
                continue
            if not stepped:
                self.release_streams()
                # Nothing to compute or release: sleep until a request arrives or is cancelled
                # (or briefly, to notice workers that reconnect and to send heartbeats).
                self.wakeup.clear()
                try:
                    await asyncio.wait_for(self.wakeup.wait(), IDLE_WAIT_SECONDS)
                except asyncio.TimeoutError:
                    pass

    async def step(self) -> dict[int, StepBuilder]:
        """One step: plan -> execute -> postprocess. Returns the plans run, by worker index:
        empty when there was nothing to do."""
        plans = self.plan_step()
        if plans:
            await self.execute(plans)
        return plans

    async def execute(self, plans: dict[int, StepBuilder]) -> None:
        """Run the plans on their workers, each worker's tokens streamed (postprocessed) as soon
        as that worker answers.

        In run(), the tokens of the step's last worker to answer reach their streams only once the
        next step's plans are sent: every client stream's handler then wakes up, and each costs
        the event loop a message (~0.1-0.2 ms); run first, they held the next plan back while the
        workers waited idle. Sent first, they run while the workers compute. Before the plans,
        postprocess only records each token (what planning needs); its text (detokenizing, stop
        strings) and chunk are made after, with the release (~15 us a token). (Tokens of a
        worker that answers while others still compute go out at once: nothing is waiting to be
        planned.)"""
        if any(b.has_work for b in plans.values()):     # heartbeats alone are no step
            self.steps += 1
        started = time.perf_counter()
        self._answers_pending = len(plans)
        loop = asyncio.get_running_loop()
        sent = {i: loop.create_future() for i in plans}
        self.cut_ins.step_started(plans)
        steps = [asyncio.ensure_future(self._execute_and_postprocess(self.workers[i], b, sent[i]))
                 for i, b in plans.items()]
        # Every plan written first (or its step over), then what waits for that: the plans' own
        # bookkeeping (settle_plans) and the streams held (streaming a step's tokens takes ~1 ms
        # per 64, and meanwhile nothing else runs, the plans' writes included). Not for long: a
        # worker whose stream takes no more must not hold up every other stream of the pool.
        holding = self.streams.holding
        if holding or self._unsettled:
            await asyncio.wait(sent.values(), timeout=PLAN_WRITE_WAIT_SECONDS)
        self.settle_plans()
        if holding:
            self.release_streams()
        await asyncio.gather(*steps)
        await self.cut_ins.settle()
        tokens = sum(b.num_tokens for b in plans.values())
        if tokens:
            stepped = [self.workers[i] for i, b in plans.items() if b.num_tokens]
            self.totals.record(time.perf_counter() - started, tokens, len(stepped),
                               sum(l.pool.num_used * l.pool.block_size for l in stepped if l.pool))

    def plan_step(self) -> dict[int, StepBuilder]:
        """Plans for every connected worker with something to do (tested directly)."""
        self.settle_plans()
        self._reap_cancelled()
        now = time.perf_counter()
        self._hand_back_orphans(now)
        policy = self.policy
        backlogged = {lane for lane in policy.lanes if policy.queue(lane)}
        backlogged |= self.planner.lanes_running()
        policy.backlog_changed(backlogged, self.clock())
        policy.forget_idle_tenants(self.clock(), self.running.values())
        builders = {}
        # Admit to a worker with a free running slot first (a request it takes preempts nobody,
        # where a full worker would have to), then to the emptiest, so load spreads.
        running, max_running = self.running, self.planner.max_running
        for link in sorted(self.workers, key=lambda l: (len(running.get(l.index, ())) >= max_running,
                                                       -(l.pool.num_free if l.pool else -1))):
            if not link.is_connected:
                continue
            builder = self.planner.plan(link, self.steps, admits=self.workers.admits(link))
            if builder.has_work or self.workers.heartbeat_due(link, now):
                builders[link.index] = builder
        self._unsettled.extend((b.decodes_by_lane, self.workers[i].pool) for i, b in builders.items())
        return builders

    def settle_plans(self) -> None:
        """The bookkeeping of the plans made last that their workers do not wait for: the tenants'
        shares of their decodes (step_builder.charge_decodes) and the peak of each class's KV
        blocks. Run once the plans are sent (execute()), else before the next plans."""
        for decodes_by_lane, pool in self._unsettled:
            charge_decodes(self.policy, decodes_by_lane)
            if pool is not None:
                for priority, held in pool.holdings().items():
                    self.kv_peak[priority] = max(self.kv_peak[priority], held)
        self._unsettled.clear()

    # --- cut-ins ------------------------------------------------------------------------------------

    def _next_step_id(self) -> int:
        step_id, self.steps = self.steps, self.steps + 1
        return step_id

    def _run_cut_in(self, link: Worker, builder: StepBuilder):
        loop = asyncio.get_running_loop()
        return self._execute_and_postprocess(link, builder, loop.create_future(), cut_in=True)

    # --- execute and postprocess ------------------------------------------------------------------

    def is_member(self, link: Worker) -> bool:
        return link.index in self.planner.running

    async def _execute_and_postprocess(self, link: Worker, builder: StepBuilder, sent: asyncio.Future,
                                       cut_in: bool = False) -> None:
        """`cut_in`: a step run inside the worker's step in flight; its tokens go to their
        streams at once (the loop plans nothing until the step in flight is answered too)."""
        try:
            # asyncio.timeout, not wait_for: no task in between, so the plan is on its way as soon
            # as this task first runs
            async with asyncio.timeout(self.step_timeout_s):
                result = await link.execute(builder.plan, sent)
        except WorkerGone as exc:
            failure = str(exc)
        except asyncio.TimeoutError:
            failure = f"worker {link.address} did not answer a step within {self.step_timeout_s:.0f} s"
            await link.close(failure)
        except Exception as exc:   # never let one link's surprise stop the loop for everyone
            log.exception("step on worker %s failed", link.address)
            failure = f"worker {link.address} failed: {exc!r}"
        else:
            failure = None
        finally:
            if not sent.done():       # the step ended before its plan was written (a failure)
                sent.set_result(None)
        if not cut_in:
            self.cut_ins.step_answered(link.index)
            self._answers_pending -= 1
        if not self.is_member(link):
            # It left the pool while this step ran (membership.leave): its sequences were moved
            # back to the queue then, so whatever it answered is nobody's any more.
            return
        if failure is not None:
            self.fail_worker(link, failure)
            return
        if self.hold_streams and self._answers_pending == 0 and not cut_in:
            self.streams.hold()        # the last answer of the step: its tokens wait for the next plans
        problem = self.postprocess(link, builder, result, at_once=cut_in)
        if problem is not None:
            await self.quarantine(link, f"worker {link.address} answered step {result.step_id} "
                                        f"against its plan: {problem}")

    def release_streams(self) -> None:
        self.streams.release()

    def postprocess(self, link: Worker, builder: StepBuilder, result: worker_pb2.StepResult,
                    at_once: bool = False) -> str | None:
        """A worker's answer to its plan: sampled tokens into the streams (`at_once`: not held
        for the next plans), finished requests out. An answer that does not match its plan
        (answer_check.py) streams nothing: what is wrong with it is returned, for quarantine()."""
        self.workers.answered(link, result.draining, time.perf_counter())
        if result.error:
            # The worker refused the plan: a bug on our side. Fail what it carried, keep serving.
            log.error("worker %s refused step %d: %s", link.address, result.step_id, result.error)
            for request in builder.scheduled_requests:
                self._finish(request, ServiceError(ErrorKind.INTERNAL,
                                                   f"worker refused the step: {result.error}"))
            return None
        if self.monitor is not None and link.pool is not None:
            self.monitor.observe(result.device.utilization, link.pool.num_free / link.pool.num_blocks)
        self.planner.computed(link, builder)
        problem = answer_mismatch(builder.scheduled_requests, sampled_seq_ids(result))
        if problem is not None:
            return problem
        sampled, ended = self.streams.answer_tokens(result, builder.scheduled_requests)
        by_seq = {r.seq_id: r for r in builder.scheduled_requests}
        now = time.perf_counter()
        output_tokens = self.output_tokens
        emit = self.streams.deliver if at_once else self.streams.emit
        new_tuple = tuple.__new__
        for seq_id, token_id in sampled:
            request = by_seq.get(seq_id)
            if request is None or request.phase is not Phase.RUNNING or request.cancelled:
                continue
            if ended and ended.get(seq_id) == FinishReason.ERROR:      # its token is not sent
                self._finish(request, grammar_dead_end(request))
                continue
            # What the next plan needs: the token counted, the first token's time, a sequence
            # the engine ended (end of sequence, max_tokens) out of the running list. Its text
            # and chunk come in _stream, after the next plans are sent in run(). (This runs
            # between a step's answer and the next plan: a few hundred tokens a step, kept lean.)
            request.add_output(token_id)
            if request.first_token_at is None:
                request.first_token_at = now
                self.recent_ttft_ms.append((now - request.arrival) * 1000)
                self.prompt_tokens[request.priority] += len(request.prompt_ids)
            output_tokens[request.priority] += 1
            engine_finish = finish_reason(ended.get(seq_id, 0)) if ended else None
            if engine_finish is not None:
                self._completed(request, now, engine_finish)
            # SampledText(token_id, engine_finish, now) without NamedTuple's Python-level __new__
            emit(request, new_tuple(SampledText, (token_id, engine_finish, now)))
        return None

    def _completed(self, request: Request, now: float, reason: FinishReason = FinishReason.STOP) -> None:
        """Ended by the engine (EOS, a stop token, its length: `reason`) or by a stop string."""
        self.finished += 1
        self._finish(request)
        if self.on_finished is not None:
            self.on_finished(request, now, reason)

    def _finish(self, request: Request, failure: ServiceError | None = None) -> None:
        request.finished_at = request.finished_at or time.perf_counter()
        if request.phase is Phase.RUNNING:
            self.planner.release(self.workers[request.worker], request)
        elif request.phase is Phase.WAITING:
            # Cancelled or not: _reap_cancelled skips a request already FINISHED, so one cancelled
            # and then failed here (an adapter unloaded under it) stayed queued and counted for good.
            self.policy.remove(request)
        request.phase = Phase.FINISHED
        if failure is not None:
            self.streams.emit(request, failure)

    def _reap_cancelled(self) -> None:
        for request in self.cancelled:
            if request.phase is Phase.WAITING:
                self.policy.remove(request)
            elif request.phase is Phase.RUNNING:
                self.planner.release(self.workers[request.worker], request)
            request.phase = Phase.FINISHED
        self.cancelled.clear()

    # --- stats --------------------------------------------------------------------------------

    def estimated_wait_ms(self, priority: int, prompt_tokens: int, tenant: str = "", weight: float = 1.0) -> float:
        """The wait admission quotes a request with an SLO (step_totals.estimated_wait_ms)."""
        return estimated_wait_ms(self.policy, self.planner.lanes_running(), self.totals.tokens_per_second,
                                 priority, prompt_tokens, tenant, weight)
