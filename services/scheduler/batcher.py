"""The continuous-batching loop: each step, plan work for every worker, run it, stream the tokens.

A step for one worker is filled lane by lane as the policy says (services/scheduler/policy.py):
each lane offers its running sequences (decodes first, then prefill chunks, oldest first) and
then its waiting requests; the policy picks which lane's next item gets tokens, until the step's
token budget is spent. KV blocks are allocated as tokens need them, within each class's cap.
When blocks run short, running sequences the policy allows are preempted (blocks freed,
requeued at the front of their lane, recomputed later; their client streams simply continue).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque

import grpc

from services.common.proto.qos.v1 import common_pb2, worker_pb2
from services.scheduler.kv_blocks import KVBlockPool, blocks_for_tokens
from services.scheduler.monitor import ResourceMonitor
from services.scheduler.policy import SchedulingPolicy
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


def cap_blocks(pool: KVBlockPool, share: float) -> int:
    return int(share * pool.num_blocks + 1e-9)


class _StepBuilder:
    """Collects one worker's plan for one step; finish() writes it into the StepPlan."""

    def __init__(self, step_id: int, budget: int, released: list[int]):
        self.plan = worker_pb2.StepPlan(step_id=step_id, released_seq_ids=released)
        self.budget = budget
        self.scheduled: list[tuple[Request, int]] = []
        self.scheduled_ids: set[int] = set()
        # Highest class (smallest Priority value) preempted this step. Afterwards only strictly
        # higher classes are admitted: admitting the victim's peers would hand its blocks back.
        self.victim_floor: int | None = None

    def note_victim(self, request: Request) -> None:
        if self.victim_floor is None or request.priority < self.victim_floor:
            self.victim_floor = request.priority

    def may_admit(self, request: Request) -> bool:
        return self.victim_floor is None or request.priority < self.victim_floor

    def add(self, request: Request, num_tokens: int) -> None:
        if request.new_blocks:
            self.plan.block_grants.add(seq_id=request.seq_id, block_ids=request.new_blocks)
            request.new_blocks = []
        self.scheduled.append((request, num_tokens))
        self.scheduled_ids.add(request.seq_id)
        self.budget -= num_tokens

    def is_scheduled(self, request: Request) -> bool:
        return request.seq_id in self.scheduled_ids

    def finish(self, released: list[int]) -> worker_pb2.StepPlan:
        self.plan.released_seq_ids.extend(released)
        self.plan.scheduled_seq_ids.extend([r.seq_id for r, _ in self.scheduled])
        self.plan.scheduled_num_tokens.extend([n for _, n in self.scheduled])
        return self.plan


class ContinuousBatcher:
    def __init__(self, pool_name: str, links: list[WorkerLink], policy: SchedulingPolicy,
                 max_running: int, max_step_tokens: int, monitor: ResourceMonitor | None = None):
        self.pool_name = pool_name
        self.links = links
        self.policy = policy
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.monitor = monitor
        self.running: dict[int, list[Request]] = {link.index: [] for link in links}
        self.to_release: dict[int, list[int]] = {link.index: [] for link in links}
        self.cancelled: set[Request] = set()
        self.wakeup = asyncio.Event()
        self.steps = 0
        self.output_tokens: Counter = Counter()
        self.served_tokens: Counter = Counter()     # prefill + decode, per priority
        self.kv_peak: Counter = Counter()           # most blocks each class held on one worker
        self.preempted_by_priority: Counter = Counter()
        self.tokens_per_second = 0.0                # served tokens, smoothed over recent steps
        self.recent_ttft_ms: deque[float] = deque(maxlen=200)
        self.on_finished = None      # callable(request, now): a request completed (metrics)

    @property
    def preemptions(self) -> int:
        return sum(self.preempted_by_priority.values())

    # --- called by the gRPC handlers ------------------------------------------------------------

    def submit(self, request: Request) -> None:
        self.policy.add(request)
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
            builders = self.plan_step()
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
            started = time.perf_counter()
            await asyncio.gather(*(self._execute(self.links[i], b) for i, b in builders.items()))
            tokens = sum(n for b in builders.values() for _, n in b.scheduled)
            if tokens:
                rate = tokens / max(time.perf_counter() - started, 1e-6)
                self.tokens_per_second = rate if not self.tokens_per_second \
                    else 0.8 * self.tokens_per_second + 0.2 * rate

    def estimated_wait_ms(self, priority: int, prompt_tokens: int) -> float:
        """Rough time to a new request's first token: the tokens queued ahead of it in its lane
        plus its own prompt, at the lane's fair share of the recent token rate. 0 when no rate
        has been measured yet."""
        if not self.tokens_per_second:
            return 0.0
        policy = self.policy
        lane = policy.lane_of_priority(priority)
        ahead = sum(r.pending for r in policy.queue(lane))
        backlogged = {l for l in policy.lanes if policy.queue(l)} | {
            policy.lane_of(r) for rs in self.running.values() for r in rs} | {lane}
        share = policy.share(lane, backlogged)
        return (ahead + prompt_tokens) / (self.tokens_per_second * share) * 1000

    def plan_step(self) -> dict[int, _StepBuilder]:
        """Plans for every connected worker with something to do (tested directly)."""
        self._reap_cancelled()
        policy = self.policy
        backlogged = {lane for lane in policy.lanes if policy.queue(lane)}
        # A running sequence always has work: the rest of its prompt or its last sampled token.
        backlogged |= {policy.lane_of(r) for rs in self.running.values() for r in rs}
        policy.backlog_changed(backlogged)
        builders = {}
        # Admit to the emptiest worker first, so load spreads across workers.
        for link in sorted(self.links, key=lambda l: -(l.pool.num_free if l.pool else -1)):
            if link.is_connected:
                builder = self._plan(link)
                if builder.scheduled or builder.plan.released_seq_ids:
                    builders[link.index] = builder
                for priority, held in link.pool.holdings().items():
                    self.kv_peak[priority] = max(self.kv_peak[priority], held)
        return builders

    def _plan(self, link: WorkerLink) -> _StepBuilder:
        released, self.to_release[link.index] = self.to_release[link.index], []
        builder = _StepBuilder(self.steps, self.max_step_tokens, released)
        policy = self.policy
        running = self.running[link.index]
        lanes: dict[int, deque[Request]] = {lane: deque() for lane in policy.lanes}
        # Within a lane: decodes first (one token each, latency-critical), then prefill chunks;
        # oldest first.
        prefills = []
        for request in running:
            if request.pending > 1:
                prefills.append(request)
            else:
                lanes[policy.lane_of(request)].append(request)
        for request in prefills:
            lanes[policy.lane_of(request)].append(request)
        active = {lane for lane in policy.lanes if lanes[lane] or policy.queue(lane)}
        while builder.budget > 0 and active:
            lane, allowance = policy.pick_lane(active)
            taken = 0
            # The lane keeps the turn until it used its allowance (at least one item).
            while builder.budget > 0 and (taken == 0 or taken < allowance):
                request = self._next_item(link, builder, lanes[lane], lane)
                if request is None:
                    active.discard(lane)
                    break
                tokens = self._schedule(link, builder, request)
                taken += tokens
                self.served_tokens[request.priority] += tokens
            if taken:
                policy.charge(lane, taken)
        # Sequences preempted while planning gave their blocks to this very plan: the worker must
        # drop them first, in the same plan.
        builder.finish(self.to_release[link.index])
        self.to_release[link.index] = []
        return builder

    def _next_item(self, link: WorkerLink, builder: _StepBuilder, running_in_lane: deque,
                   lane: int) -> Request | None:
        """The lane's next running sequence, else its next admissible waiting request, else None."""
        while running_in_lane:
            request = running_in_lane.popleft()
            if request.phase is Phase.RUNNING:   # not preempted a moment ago to make room
                return request
        queue = self.policy.queue(lane)
        if not queue or not builder.may_admit(queue[0]):
            return None
        if len(self.running[link.index]) >= self.max_running and not self._free_slot(link, builder, queue[0]):
            return None
        if self._admit(link, builder, queue[0]):
            return self.running[link.index][-1]
        return None

    def _free_slot(self, link: WorkerLink, builder: _StepBuilder, request: Request) -> bool:
        """All running slots are taken: preempt one sequence the policy lets `request` displace
        (lowest class, newest first), if any."""
        for victim in sorted(self.running[link.index], key=lambda r: (-r.priority, -r.seq_id)):
            if not builder.is_scheduled(victim) and self.policy.may_preempt(request, victim, admitting=True):
                self._preempt(link, victim)
                builder.note_victim(victim)
                return True
        return False

    def _admit(self, link: WorkerLink, builder: _StepBuilder, request: Request) -> bool:
        # Admit only when the whole known sequence (+1 for its next token) fits now, so admitted
        # prompts rarely need to preempt others to finish their prefill.
        need = blocks_for_tokens(request.num_tokens + 1, link.pool.block_size)
        if not self._make_room(link, builder, request, need, admitting=True):
            return False
        self.policy.remove(request)
        request.phase = Phase.RUNNING
        request.worker = link.index
        request.computed = 0
        request.announced = False
        request.first_scheduled_at = request.first_scheduled_at or time.perf_counter()
        self.running[link.index].append(request)
        return True

    def _make_room(self, link: WorkerLink, builder: _StepBuilder, request: Request, need: int,
                   admitting: bool) -> bool:
        """Ensure `need` more blocks fit the pool and the request's class cap, preempting what the
        policy allows (lowest class first, newest first) only if that is enough."""
        pool = link.pool
        cap = cap_blocks(pool, self.policy.kv_cap(request.priority))
        short_pool = need - pool.num_free
        short_cap = pool.held(request.priority) + need - cap
        if short_pool <= 0 and short_cap <= 0:
            return True
        victims = []
        for victim in sorted(self.running[link.index], key=lambda r: (-r.priority, -r.seq_id)):
            if short_pool <= 0 and short_cap <= 0:
                break
            if victim is request or builder.is_scheduled(victim) or not victim.blocks \
                    or not self.policy.may_preempt(request, victim, admitting):
                continue
            same_class = victim.priority == request.priority
            if short_pool <= 0 and not same_class:
                continue   # only the cap binds, and other classes' blocks do not count against it
            victims.append(victim)
            short_pool -= len(victim.blocks)
            if same_class:
                short_cap -= len(victim.blocks)
        if short_pool > 0 or short_cap > 0:
            return False
        for victim in victims:
            self._preempt(link, victim)
            builder.note_victim(victim)
        return True

    def _schedule(self, link: WorkerLink, builder: _StepBuilder, request: Request) -> int:
        """Schedule the request's next chunk (as much as fits); returns the tokens scheduled."""
        pool = link.pool
        pending = request.pending
        num_tokens = pending if pending < builder.budget else builder.budget
        need = blocks_for_tokens(request.computed + num_tokens, pool.block_size) - len(request.blocks)
        if need > 0 and not self._make_room(link, builder, request, need, admitting=False):
            # Shrink the chunk to the blocks there are; with none, this request yields itself.
            room = min(pool.num_free, cap_blocks(pool, self.policy.kv_cap(request.priority))
                       - pool.held(request.priority))
            num_tokens = min((len(request.blocks) + max(room, 0)) * pool.block_size - request.computed,
                             pending, builder.budget)
            if num_tokens <= 0:
                self._preempt(link, request)
                builder.note_victim(request)
                return 0
            need = blocks_for_tokens(request.computed + num_tokens, pool.block_size) - len(request.blocks)
        if need > 0:
            blocks = pool.allocate(request.priority, need)
            request.blocks.extend(blocks)
            request.new_blocks.extend(blocks)
        if not request.announced:
            builder.plan.new_sequences.append(worker_pb2.NewSequence(
                seq_id=request.seq_id, prompt_token_ids=request.all_ids,
                sampling=engine_sampling(request), num_generated=len(request.output_ids),
                traceparent=request.traceparent))
            request.announced = True
        builder.add(request, num_tokens)
        return num_tokens

    def _preempt(self, link: WorkerLink, request: Request) -> None:
        log.info("preempting %s (%d tokens) on worker %d", request.request_id, request.num_tokens,
                 link.index)
        self.preempted_by_priority[request.priority] += 1
        request.preemptions += 1
        self._release(link, request)
        request.phase = Phase.WAITING
        self.policy.add_front(request)

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
        if self.monitor is not None and link.pool is not None:
            self.monitor.observe(result.device.utilization, link.pool.num_free / link.pool.num_blocks)
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
            self.recent_ttft_ms.append((now - request.arrival) * 1000)
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
            if self.on_finished is not None:
                self.on_finished(request, now)
        else:
            chunk.timings.CopyFrom(request.timings())
            request.events.put_nowait(chunk)

    def _finish(self, request: Request, failure: Failure | None = None) -> None:
        request.finished_at = request.finished_at or time.perf_counter()
        if request.phase is Phase.RUNNING:
            self._release(self.links[request.worker], request)
        elif request.phase is Phase.WAITING and not request.cancelled:
            self.policy.remove(request)
        request.phase = Phase.FINISHED
        if failure is not None:
            request.events.put_nowait(failure)

    def _reap_cancelled(self) -> None:
        for request in self.cancelled:
            if request.phase is Phase.WAITING:
                self.policy.remove(request)
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
