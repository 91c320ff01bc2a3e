"""Planning one step for one worker: which sequences compute how many tokens, who is admitted,
who is preempted, which KV blocks are granted.

A step is filled lane by lane as the policy says (services/scheduler/policy.py): each lane offers
its running sequences (decodes first, then prefill chunks, oldest first) and then its waiting
requests; the policy picks which lane's next item gets tokens, until the step's token budget is
spent. KV blocks are allocated as tokens need them, within each class's cap. When blocks or
running slots run short, running sequences the policy allows are preempted (room.py chooses them;
here their blocks are freed and they are requeued at the front of their lane, to be recomputed
later; their client streams simply continue).
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from itertools import chain
from operator import attrgetter

from services.common.kv_blocks import blocks_for_tokens
from services.common.priority import ORDER
from services.scheduler.announcement import announce
from services.scheduler.lane_work import LaneWork
from services.scheduler.long_context import PassedBlocks
from services.scheduler.policy import SchedulingPolicy
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.request import Phase, Request
from services.scheduler.room import Room
from services.scheduler.step_builder import StepBuilder
from services.scheduler.victims import add_running
from services.scheduler.worker_view import Worker

log = logging.getLogger(__name__)
_PRIORITY = attrgetter("priority")


class StepPlanner:
    """The sequences running on each worker, and the planning of their steps."""

    def __init__(self, policy: SchedulingPolicy, max_running: int, max_step_tokens: int,
                 prefix_cache: PrefixCache | None = None):
        self.policy = policy
        self.prefix_cache = prefix_cache      # None: no prefix caching (every prompt computed)
        self.max_running = max_running
        # Running slots beyond max_running that High cut-ins may take (policy's high_cut_in_slots).
        # A cut-in cannot preempt, and under a burst every slot is taken: without these, High
        # requests waited for the step in flight and were admitted by preemption (the paired burst
        # comparison in docs/performance.md: High's P99 TTFT about 1.9x). The worker goes back
        # under max_running as sequences end; meanwhile only High is admitted, by preempting.
        self.cut_in_slots = policy.cut_in_slots(max_running)
        self.max_step_tokens = max_step_tokens
        self.running: dict[int, list[Request]] = {}
        self.to_release: dict[int, list[int]] = {}     # seq ids the worker must drop next step
        self.held_adapters: set[str] = set()  # LoRA adapters being (re)loaded: none admitted (pool_adapters.py)
        self.passed = PassedBlocks()    # streaming sequences' blocks no later token reads
        self.stream_chunk = 1 << 30     # the largest prompt chunk of a streaming sequence (config)
        self.served_tokens: Counter = Counter()       # prefill + decode, per priority
        self.admitted: Counter = Counter()            # sequences placed on each worker
        self.preempted_by_priority: Counter = Counter()
        self.recomputed_tokens: Counter = Counter()   # per priority: work preemption threw away
        self.running_per_lane: Counter = Counter()    # all workers together
        # Per worker and priority, its running sequences in seq_id order (room.add_running): a
        # preemption's victims come from one class, found without a pass over the whole worker.
        self.running_by_class: dict[int, dict[int, list[Request]]] = {}
        # Workers that ran a cut-in during their last step: the next plan gives the first-token
        # lane the turn the cut-in took from it (plan_cut_in).
        self.after_cut_in: set[int] = set()
        # Prefix caching over several workers: whether a worker may admit a request now
        # (PrefixCache.placer: the one holding its longest cached prefix, unless load wins).
        self.may_place: Callable[[Worker, Request], bool] | None = None
        self.room = Room(policy, self.running, self.running_by_class, self.preempt,
                         prefix_cache.work_lost if prefix_cache is not None else None)

    def lanes_running(self) -> set[int]:      # each has work: the rest of a prompt, or a token
        return {lane for lane, count in self.running_per_lane.items() if count}

    def add_worker(self, index: int) -> None:
        self.running.setdefault(index, [])
        self.running_by_class.setdefault(index, {priority: [] for priority in ORDER})
        self.to_release.setdefault(index, [])

    def remove_worker(self, index: int) -> None:
        """Forget a worker that left; its sequences were moved off it first."""
        assert not self.running.get(index), "remove_worker with sequences still on it"
        self.running.pop(index, None)
        self.running_by_class.pop(index, None)
        self.to_release.pop(index, None)
        self.passed.forget(index)
        self.after_cut_in.discard(index)

    def plan(self, worker: Worker, step_id: int, admits: bool = True) -> StepBuilder:
        """The worker's next step (`admits` False: a draining worker, no new sequences)."""
        released, self.to_release[worker.index] = self.to_release[worker.index], []
        policy = self.policy
        builder = StepBuilder(step_id, self.max_step_tokens, released, admits)
        work = LaneWork(self.running[worker.index], policy.lanes, policy.lane_by_priority)
        active = {lane for lane in policy.lanes if work.has_running(lane) or policy.queue(lane)}
        first = policy.first_token_lane()
        after_cut_in = worker.index in self.after_cut_in
        self.after_cut_in.discard(worker.index)
        first_turn = first is not None and first in active
        builder.first_tokens = first_turn and bool(policy.queue(first) or work.first_token_pending(first))
        if builder.first_tokens or (first_turn and after_cut_in):
            # The real-time class has a request waiting for its first token: its work goes ahead of
            # the fair-queueing order (its virtual time is charged all the same, so the others get
            # the tokens back later), and when all of that first-token work fits in the step, the
            # step carries nothing else, not even the class's own decodes: on a busy pool each
            # running sequence costs a step about as much as a short prompt (the logits and
            # sampling over the vocabulary alone), so the first token comes from a step about as
            # short as an idle pool's. Work that does not fit goes with everything else (a long
            # prompt alone would stall the class's streams for steps).
            waiting = self._first_token_work(work, first, builder.budget)
            if waiting is not None and self._serve_first_tokens(worker, builder, waiting, first):
                active.clear()
            else:
                self._serve(worker, builder, work, first, math.inf, active)
                active.discard(first)
        while builder.budget > 0 and active:
            lane, allowance = policy.pick_lane(active)
            self._serve(worker, builder, work, lane, allowance, active)
        for lane in policy.lanes:
            builder.charge_tenants(policy, lane)
        self.served_tokens.update(builder.served)
        # Sequences preempted while planning gave their blocks to this very plan: the worker must
        # drop them first, in the same plan.
        builder.finish(self.to_release[worker.index])
        self.to_release[worker.index] = []
        self.passed.into(builder.plan, worker.index)
        return builder

    def computed(self, worker: Worker, builder: StepBuilder) -> None:
        """The worker computed the plan: its running sequences advance; blocks they filled are
        named (prefix caching), blocks streaming ones passed go (long_context.PassedBlocks)."""
        for request, num_tokens in zip(builder.scheduled_requests, builder.scheduled_tokens):
            if request.phase is Phase.RUNNING and request.pool is worker.pool:
                request.advance(num_tokens)
                if request.computed >= request.next_name_at:    # it filled a block: name it
                    self.prefix_cache.name_computed(worker.pool, request)
                if request.window is not None:
                    self.passed.after_step(worker, request)

    def plan_cut_in(self, worker: Worker, step_id: int, budget: int | None = None) -> StepBuilder | None:
        """A step for the worker to run inside the one it is computing (StepPlan.cut_in), or None
        when there is nothing to cut in with: the first-token lane's queued requests whose whole
        prompt fits the step (or `budget` tokens) and whose blocks are free now, with a running slot
        free or one of `cut_in_slots` beyond max_running (no preemption: every sequence on the
        worker may be in the step in flight; no LoRA: it must not move adapters under that step).
        Only new sequences: nothing the step in flight touches."""
        lane = self.policy.first_token_lane()
        queue = self.policy.queue(lane) if lane is not None else None
        if not queue:
            return None
        pool, running = worker.pool, self.running[worker.index]
        builder = StepBuilder(step_id, self.max_step_tokens if budget is None else budget, [])
        builder.plan.cut_in = True
        builder.charge_tenants(self.policy, lane)       # admissions: tenant order must be current
        taken = 0
        slots = self.max_running + self.cut_in_slots
        while (head := queue.peek()) is not None and not head.lora and head.window is None \
                and len(running) < slots \
                and (self.may_place is None or self.may_place(worker, head)):
            if head.num_tokens > builder.budget or \
                    blocks_for_tokens(head.num_tokens + 1, pool.block_size) > self.room.free_for(pool, head.priority):
                break
            if not self._admit(worker, builder, head):      # room was checked: not expected
                break
            tokens = self._schedule(worker, builder, head)
            builder.note_served(head, tokens, lane)
            taken += tokens
        if not taken:
            return None
        # The step after it is planned as the first-token step would have been had these requests
        # waited for it: the lane first. That step gives the new streams their second token soon,
        # as without cut-ins.
        self.after_cut_in.add(worker.index)
        self.policy.charge(lane, taken)
        builder.charge_tenants(self.policy, lane)
        self.served_tokens.update(builder.served)
        builder.finish([])
        return builder

    def _serve(self, worker: Worker, builder: StepBuilder, work: LaneWork, lane: int,
               allowance: float, active: set[int]) -> int:
        """The lane's turn: its running sequences, then admissions, until it used its allowance
        (at least one item) or the budget; a lane with nothing left leaves `active`. Returns the
        tokens it took."""
        taken = 0
        others = work.others[lane]
        while builder.budget > 0 and (taken == 0 or taken < allowance):
            ready, boundary = work.take_ready(lane, allowance - taken, builder.budget)
            if ready and builder.victim_floor is not None:      # someone was preempted this step
                ready = [r for r in ready if r.phase is Phase.RUNNING]
                if not ready:
                    continue
            if ready:
                if boundary and not self.room.grant_blocks(worker, builder, ready, lane):
                    taken += self._schedule_each(worker, builder, ready, lane)   # short of room
                    continue
                taken += builder.add_decodes(ready, lane, self.policy.lane_is_class)
                continue
            if not others:
                builder.charge_tenants(self.policy, lane)   # admissions next: tenant order must be current
            tokens = self._serve_next_item(worker, builder, others, lane)
            if tokens is None:
                active.discard(lane)
                break
            taken += tokens
        if taken:
            self.policy.charge(lane, taken)
        return taken

    def _first_token_work(self, work: LaneWork, lane: int, budget: int) -> list[Request] | None:
        """The lane's running sequences still waiting for their first token, when what is left of
        their prompts and the lane's queued prompts fit in `budget` tokens together; else None."""
        waiting = [r for r in chain(work.ready[lane], work.boundary[lane], work.others[lane])
                   if r.first_token_at is None]
        tokens = sum(r.pending for r in waiting)
        for request in self.policy.queue(lane):
            if tokens > budget:
                break
            if request.first_token_at is None:
                tokens += request.pending
        return waiting if tokens <= budget else None

    def _serve_first_tokens(self, worker: Worker, builder: StepBuilder, waiting: list[Request], lane: int) -> int:
        """The lane's first-token turn alone: its sequences still waiting for their first token
        (`waiting`, from _first_token_work), then its admissions; returns the tokens it took."""
        taken = self._schedule_each(worker, builder, waiting, lane)
        if builder.budget > 0:
            builder.charge_tenants(self.policy, lane)   # admissions next: tenant order must be current
        admissions: deque[Request] = deque()            # no running sequence: the queue's heads only
        while builder.budget > 0 and (tokens := self._serve_next_item(worker, builder, admissions, lane)) is not None:
            taken += tokens
        if taken:
            self.policy.charge(lane, taken)
        return taken

    def _schedule_each(self, worker: Worker, builder: StepBuilder, requests: list[Request], lane: int) -> int:
        """_schedule each request still running, in turn; returns the tokens scheduled."""
        taken = 0
        for request in requests:
            if request.phase is Phase.RUNNING:      # not preempted a moment ago to make room
                tokens = self._schedule(worker, builder, request)
                taken += tokens
                builder.note_served(request, tokens, lane)
        return taken

    def _serve_next_item(self, worker: Worker, builder: StepBuilder, running_in_lane: deque,
                         lane: int) -> int | None:
        """Schedule the lane's next item (_next_item); the tokens it got, or None when there is none."""
        request = self._next_item(worker, builder, running_in_lane, lane)
        if request is None:
            return None
        tokens = self._schedule(worker, builder, request)
        builder.note_served(request, tokens, lane)
        return tokens

    def _next_item(self, worker: Worker, builder: StepBuilder, running_in_lane: deque,
                   lane: int) -> Request | None:
        """The lane's next running sequence, else its next admissible waiting request, else None."""
        while running_in_lane:
            request = running_in_lane.popleft()
            if request.phase is Phase.RUNNING:   # not preempted a moment ago to make room
                return request
        if len(self.running[worker.index]) >= self.max_running and not self.policy.lane_may_displace(lane):
            return None         # a full worker, and no request of the lane may preempt to get in
        head = self.policy.queue(lane).peek()
        if head is None or not builder.may_admit(head):
            return None
        if head.lora and not self._lora_fits(worker, head.lora):
            return None
        if self.may_place is not None and not self.may_place(worker, head):
            return None         # another worker holds more of it in its cache, or computes it now
        if len(self.running[worker.index]) >= self.max_running \
                and not self.room.free_slot(worker, builder, head):
            return None
        if self._admit(worker, builder, head):
            return self.running[worker.index][-1]
        return None

    def _lora_fits(self, worker: Worker, lora: str) -> bool:
        """The worker holds the adapter (else another worker of the pool takes the request), and
        one more adapter among its running sequences stays within its max_loras."""
        if lora not in worker.adapters or lora in self.held_adapters:
            return False
        running = {r.lora for r in self.running[worker.index] if r.lora}
        return lora in running or len(running) < worker.max_loras

    def _admit(self, worker: Worker, builder: StepBuilder, request: Request) -> bool:
        # Admit only when the whole known sequence (+1 for its next token) fits now, so admitted
        # prompts rarely need to preempt others to finish their prefill. Blocks the worker holds
        # of its prefix (prefix caching) are shared first: they need no room of their own.
        pool, cache = worker.pool, self.prefix_cache
        if request.window is not None:
            cache = None        # streaming KV is not a dense prefix's: neither shared nor named
        cached, woken = cache.take_cached(pool, request) if cache is not None else ((), None)
        need = blocks_for_tokens(request.num_tokens + 1, pool.block_size) - len(cached)
        if request.window is not None:      # it keeps at most its window's blocks
            need = min(need, request.window.max_blocks(self.stream_chunk, pool.block_size))
        if not self.room.make_room(worker, builder, request, need, admitting=True):
            if cached:
                pool.free(request.priority, cached, woken)
            return False
        self.policy.remove(request)
        request.phase = Phase.RUNNING
        request.worker, request.pool = worker.index, pool
        request.reset_cache()
        if cache is not None:       # cached blocks (and its prefix in a second tier) become its first
            cache.admitted(pool, request, cached, first=request.first_scheduled_at is None)
        request.announced = False
        request.first_scheduled_at = request.first_scheduled_at or time.perf_counter()
        self.running[worker.index].append(request)
        self.running_per_lane[self.policy.lane_of(request)] += 1
        add_running(self.running_by_class[worker.index], request)
        self.admitted[worker.index] += 1
        return True

    def _schedule(self, worker: Worker, builder: StepBuilder, request: Request) -> int:
        """Schedule the request's next chunk (as much as fits); returns the tokens scheduled."""
        pool = worker.pool
        pending = request.pending
        num_tokens = pending if pending < builder.budget else builder.budget
        held = len(request.blocks) + request.dropped_blocks     # dropped: streaming mode's passed blocks
        if request.window is not None:
            num_tokens = min(num_tokens, self.stream_chunk)
        need = blocks_for_tokens(request.computed + num_tokens, pool.block_size) - held
        if need > 0 and not self.room.make_room(worker, builder, request, need, admitting=False):
            # Shrink the chunk to the blocks there are; with none, this request yields itself.
            room = self.room.free_for(pool, request.priority)
            num_tokens = min((held + max(room, 0)) * pool.block_size - request.computed, num_tokens)
            if num_tokens <= 0:
                self.preempt(worker, request)
                builder.note_victim(request)
                return 0
            need = blocks_for_tokens(request.computed + num_tokens, pool.block_size) - held
        if need > 0:
            blocks = pool.allocate(request.priority, need)
            request.add_blocks(blocks, pool.block_size)
            request.new_blocks.extend(blocks)
        if not request.announced:
            announce(builder.plan, request)
            request.announced = True
        builder.add(request, num_tokens)
        return num_tokens

    def preempt(self, worker: Worker, request: Request) -> None:
        log.info("preempting %s (%d tokens) on worker %d", request.request_id, request.num_tokens,
                 worker.index)
        self.preempted_by_priority[request.priority] += 1
        self.recomputed_tokens[request.priority] += request.computed
        request.preemptions += 1
        self.release(worker, request)
        request.phase = Phase.WAITING
        self.policy.add_front(request)

    def release(self, worker: Worker, request: Request) -> None:
        """Take a running request off its worker: blocks back to the pool that gave them (not to
        a new one since: the old went with its blocks), its state dropped there."""
        if request.blocks and request.pool is worker.pool is not None:
            worker.pool.free(request.priority, request.blocks)
        if request.leading:     # blocks it computes that others wait for (prefix_in_flight.py)
            self.prefix_cache.released(request.pool, request)
        request.reset_cache()
        if request.announced:
            self.to_release[worker.index].append(request.seq_id)
        request.announced = False
        request.worker = request.pool = None
        self.running[worker.index].remove(request)
        self.running_per_lane[self.policy.lane_of(request)] -= 1
        self.running_by_class[worker.index][request.priority].remove(request)
