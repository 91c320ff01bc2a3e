"""Planning one step for one worker: which sequences compute how many tokens, who is admitted,
who is preempted, which KV blocks are granted.

A step is filled lane by lane as the policy says (services/scheduler/policy.py): each lane offers
its running sequences (decodes first, then prefill chunks, oldest first) and then its waiting
requests; the policy picks which lane's next item gets tokens, until the step's token budget is
spent. KV blocks are allocated as tokens need them, within each class's cap. When blocks run
short, running sequences the policy allows are preempted (blocks freed, requeued at the front of
their lane, recomputed later; their client streams simply continue).
"""
from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Protocol

from services.common.kv_blocks import KVBlockPool, blocks_for_tokens, cap_blocks
from services.common.proto.qos.v1 import worker_pb2
from services.common.wire import engine_sampling
from services.scheduler.policy import SchedulingPolicy
from services.scheduler.request import Phase, Request

log = logging.getLogger(__name__)


class Worker(Protocol):
    """What planning needs of a worker link (services/scheduler/worker_link.py, or a test double)."""
    index: int
    pool: KVBlockPool | None
    adapters: frozenset[str]          # LoRA adapters it holds
    max_loras: int                    # distinct adapters its running sequences may use


class StepBuilder:
    """Collects one worker's plan for one step; finish() writes it into the StepPlan."""

    def __init__(self, step_id: int, budget: int, released: list[int], admits: bool = True):
        self.plan = worker_pb2.StepPlan(step_id=step_id, released_seq_ids=released)
        self.budget = budget
        self.admits = admits        # False: the worker drains, only its running sequences go on
        self.scheduled: list[tuple[Request, int]] = []
        self.scheduled_ids: set[int] = set()
        # Highest class (smallest Priority value) preempted this step. Afterwards only strictly
        # higher classes are admitted: admitting the victim's peers would hand its blocks back.
        self.victim_floor: int | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.scheduled or self.plan.released_seq_ids)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def note_victim(self, request: Request) -> None:
        if self.victim_floor is None or request.priority < self.victim_floor:
            self.victim_floor = request.priority

    def may_admit(self, request: Request) -> bool:
        return self.admits and (self.victim_floor is None or request.priority < self.victim_floor)

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


def _victim_order(request: Request) -> tuple[int, int]:
    """Preemption order: lowest class first, newest first."""
    return -request.priority, -request.seq_id


class StepPlanner:
    """The sequences running on each worker, and the planning of their steps."""

    def __init__(self, policy: SchedulingPolicy, max_running: int, max_step_tokens: int):
        self.policy = policy
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.running: dict[int, list[Request]] = {}
        self.to_release: dict[int, list[int]] = {}     # seq ids the worker must drop next step
        self.served_tokens: Counter = Counter()       # prefill + decode, per priority
        self.admitted: Counter = Counter()            # sequences placed on each worker
        self.preempted_by_priority: Counter = Counter()

    def add_worker(self, index: int) -> None:
        self.running.setdefault(index, [])
        self.to_release.setdefault(index, [])

    def remove_worker(self, index: int) -> None:
        """Forget a worker that left; its sequences were moved off it first."""
        assert not self.running.get(index), "remove_worker with sequences still on it"
        self.running.pop(index, None)
        self.to_release.pop(index, None)

    def plan(self, worker: Worker, step_id: int, admits: bool = True) -> StepBuilder:
        released, self.to_release[worker.index] = self.to_release[worker.index], []
        builder = StepBuilder(step_id, self.max_step_tokens, released, admits)
        policy = self.policy
        lanes: dict[int, deque[Request]] = {lane: deque() for lane in policy.lanes}
        # Within a lane: decodes first (one token each, latency-critical), then prefill chunks;
        # oldest first.
        prefills = []
        for request in self.running[worker.index]:
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
                request = self._next_item(worker, builder, lanes[lane], lane)
                if request is None:
                    active.discard(lane)
                    break
                tokens = self._schedule(worker, builder, request)
                taken += tokens
                self.served_tokens[request.priority] += tokens
                policy.charge_tenant(request, tokens)
            if taken:
                policy.charge(lane, taken)
        # Sequences preempted while planning gave their blocks to this very plan: the worker must
        # drop them first, in the same plan.
        builder.finish(self.to_release[worker.index])
        self.to_release[worker.index] = []
        return builder

    def _next_item(self, worker: Worker, builder: StepBuilder, running_in_lane: deque,
                   lane: int) -> Request | None:
        """The lane's next running sequence, else its next admissible waiting request, else None."""
        while running_in_lane:
            request = running_in_lane.popleft()
            if request.phase is Phase.RUNNING:   # not preempted a moment ago to make room
                return request
        head = self.policy.queue(lane).peek()
        if head is None or not builder.may_admit(head):
            return None
        if head.lora and not self._lora_fits(worker, head.lora):
            return None
        if len(self.running[worker.index]) >= self.max_running \
                and not self._free_slot(worker, builder, head):
            return None
        if self._admit(worker, builder, head):
            return self.running[worker.index][-1]
        return None

    def _lora_fits(self, worker: Worker, lora: str) -> bool:
        """The worker holds the adapter (else another worker of the pool takes the request), and
        one more adapter among its running sequences stays within its max_loras."""
        if lora not in worker.adapters:
            return False
        running = {r.lora for r in self.running[worker.index] if r.lora}
        return lora in running or len(running) < worker.max_loras

    def _free_slot(self, worker: Worker, builder: StepBuilder, request: Request) -> bool:
        """All running slots are taken: preempt one sequence the policy lets `request` displace,
        if any."""
        for victim in sorted(self.running[worker.index], key=_victim_order):
            if not builder.is_scheduled(victim) and self.policy.may_preempt(request, victim, admitting=True):
                self.preempt(worker, victim)
                builder.note_victim(victim)
                return True
        return False

    def _admit(self, worker: Worker, builder: StepBuilder, request: Request) -> bool:
        # Admit only when the whole known sequence (+1 for its next token) fits now, so admitted
        # prompts rarely need to preempt others to finish their prefill.
        need = blocks_for_tokens(request.num_tokens + 1, worker.pool.block_size)
        if not self._make_room(worker, builder, request, need, admitting=True):
            return False
        self.policy.remove(request)
        request.phase = Phase.RUNNING
        request.worker = worker.index
        request.computed = 0
        request.announced = False
        request.first_scheduled_at = request.first_scheduled_at or time.perf_counter()
        self.running[worker.index].append(request)
        self.admitted[worker.index] += 1
        return True

    def _cap(self, pool: KVBlockPool, request: Request) -> int:
        return cap_blocks(pool.num_blocks, self.policy.kv_cap(request.priority))

    def _make_room(self, worker: Worker, builder: StepBuilder, request: Request, need: int,
                   admitting: bool) -> bool:
        """Ensure `need` more blocks fit the pool and the request's class cap, preempting what the
        policy allows (lowest class first, newest first) only if that is enough."""
        pool = worker.pool
        short_pool = need - pool.num_free
        short_cap = pool.held(request.priority) + need - self._cap(pool, request)
        if short_pool <= 0 and short_cap <= 0:
            return True
        victims = []
        for victim in sorted(self.running[worker.index], key=_victim_order):
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
            self.preempt(worker, victim)
            builder.note_victim(victim)
        return True

    def _schedule(self, worker: Worker, builder: StepBuilder, request: Request) -> int:
        """Schedule the request's next chunk (as much as fits); returns the tokens scheduled."""
        pool = worker.pool
        pending = request.pending
        num_tokens = pending if pending < builder.budget else builder.budget
        need = blocks_for_tokens(request.computed + num_tokens, pool.block_size) - len(request.blocks)
        if need > 0 and not self._make_room(worker, builder, request, need, admitting=False):
            # Shrink the chunk to the blocks there are; with none, this request yields itself.
            room = min(pool.num_free, self._cap(pool, request) - pool.held(request.priority))
            num_tokens = min((len(request.blocks) + max(room, 0)) * pool.block_size - request.computed,
                             pending, builder.budget)
            if num_tokens <= 0:
                self.preempt(worker, request)
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
                sampling=engine_sampling(request.sampling), num_generated=len(request.output_ids),
                traceparent=request.traceparent, lora=request.lora))
            request.announced = True
        builder.add(request, num_tokens)
        return num_tokens

    def preempt(self, worker: Worker, request: Request) -> None:
        log.info("preempting %s (%d tokens) on worker %d", request.request_id, request.num_tokens,
                 worker.index)
        self.preempted_by_priority[request.priority] += 1
        request.preemptions += 1
        self.release(worker, request)
        request.phase = Phase.WAITING
        self.policy.add_front(request)

    def release(self, worker: Worker, request: Request) -> None:
        """Take a running request off its worker: blocks back to the pool, state dropped there."""
        if request.blocks and worker.pool is not None:
            worker.pool.free(request.priority, request.blocks)
        request.blocks, request.new_blocks = [], []
        request.computed = 0
        if request.announced:
            self.to_release[worker.index].append(request.seq_id)
        request.announced = False
        request.worker = None
        self.running[worker.index].remove(request)
