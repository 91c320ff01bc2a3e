"""Room for a sequence on one worker: KV blocks within its class's cap (strict or elastic), a
running slot, and the preemption of what the policy allows when there is not enough; blocks for a
step's decodes that start one, all at once.

The planner (planner.py) asks while it fills a step; the preempting itself (blocks back to the
pool, the request back at the front of its queue) is the planner's, which owns the running lists.
Victims are taken in VictimOrder: the lowest class first, and in it the sequence that loses the
least work (victims.py). Pure Python, tested through the planner (tests/unit/test_qos_scheduling.py).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from operator import attrgetter

from services.common.kv_blocks import KVBlockPool, cap_blocks
from services.common.priority import ORDER
from services.scheduler.policy import SchedulingPolicy
from services.scheduler.request import Phase, Request
from services.scheduler.step_builder import StepBuilder
from services.scheduler.victims import VictimOrder
from services.scheduler.worker_view import Worker

_PRIORITY = attrgetter("priority")


class Room:
    """Blocks and slots for requests on the workers' running lists (shared with the planner)."""

    def __init__(self, policy: SchedulingPolicy, running: dict[int, list[Request]],
                 running_by_class: dict[int, dict[int, list[Request]]], preempt: Callable[[Worker, Request], None],
                 work_lost: Callable[[Request, int], int] | None = None):
        self.policy = policy
        # With prefix caching: the tokens a victim would compute again (prefix_cache.work_lost),
        # for VictimOrder; None: all it computed.
        self.work_lost = work_lost
        self.running = running
        self.running_by_class = running_by_class       # per worker and priority: its running sequences
        self._preempt = preempt

    def victims(self, worker: Worker, builder: StepBuilder, requester: Request,
                admitting: bool) -> list[Request]:
        """Candidates for preemption by `requester`, in VictimOrder: under a policy that preempts
        by class, only its lower classes (and its own when not admitting); else every class."""
        if builder.victims is None:
            lost = self.work_lost
            block_size = worker.pool.block_size
            builder.victims = VictimOrder(self.running_by_class[worker.index],
                                          None if lost is None else lambda r: lost(r, block_size))
        if not self.policy.preempts_by_class:
            return builder.victims.down_to(builder.scheduled_set(), min(ORDER))
        return builder.victims.down_to(builder.scheduled_set(), requester.priority, inclusive=not admitting)

    def grant_blocks(self, worker: Worker, builder: StepBuilder, decodes: list[Request], lane: int) -> bool:
        """A block each for decodes whose next token starts one (all of `lane`), all at once, when
        the pool and every class's cap have room for all of them (the common case); else False,
        nothing taken: then each goes through the planner's _schedule, which preempts or yields as
        the policy allows."""
        pool = worker.pool
        if len(decodes) > pool.num_free:
            return False
        by_class = {lane: len(decodes)} if self.policy.lane_is_class else Counter(map(_PRIORITY, decodes))
        for priority, count in by_class.items():
            if count > self.free_for(pool, priority):
                return False
        block_size = pool.block_size
        for priority, count in by_class.items():
            takers = decodes if len(by_class) == 1 else [r for r in decodes if r.priority == priority]
            blocks = pool.allocate(priority, count)
            for request, block in zip(takers, blocks):
                request.add_blocks((block,), block_size)
            builder.grant_each(takers, blocks)
        return True

    def free_slot(self, worker: Worker, builder: StepBuilder, request: Request) -> bool:
        """All running slots are taken: preempt one sequence the policy lets `request` displace,
        if any."""
        if not self.policy.admission_may_preempt(request):
            return False
        if not self._unscheduled_below(worker, builder, request.priority):
            # Every lower-class sequence has work in this step already, and none of those is
            # displaced: on a full pool that is most admission attempts late in a plan, and
            # finding it out from the victim order would sort them all first.
            return False
        victims = self.victims(worker, builder, request, admitting=True)
        for i in range(builder.slot_cursor, len(victims)):
            victim = victims[i]
            if victim.priority <= request.priority:
                return False        # an admission displaces only lower classes (lowest first)
            if victim.phase is not Phase.RUNNING or builder.is_scheduled(victim):
                if i == builder.slot_cursor:
                    builder.slot_cursor += 1    # out of reach for the rest of this plan
                continue
            if self.policy.may_preempt(request, victim, admitting=True):
                self._preempt(worker, victim)
                builder.note_victim(victim)
                return True
        return False

    def _unscheduled_below(self, worker: Worker, builder: StepBuilder, priority: int) -> bool:
        """Some sequence of a class below `priority` runs on the worker and is not scheduled yet
        in this step (counted, not looked for)."""
        scheduled = builder.sequences_by_priority
        return any(len(running) > scheduled[lower] for lower, running in self.running_by_class[worker.index].items()
                   if lower > priority)

    def class_cap(self, pool: KVBlockPool, priority: int) -> int:
        """The most blocks the class may hold on this worker under its cap."""
        return cap_blocks(pool.num_blocks, self.policy.kv_cap(priority))

    def cap(self, pool: KVBlockPool, priority: int) -> int:
        """The most blocks the class may hold now (its cap, or all while elastic and alone)."""
        policy = self.policy
        if policy.elastic_caps and not any(policy.queue(lane) for lane in policy.lanes
                                           if lane != policy.lane_of_priority(priority)):
            return pool.num_blocks        # elastic, and no other class waits: borrow freely
        return self.class_cap(pool, priority)

    def free_for(self, pool: KVBlockPool, priority: int) -> int:
        """Blocks the class may take now without preempting anyone: the pool's free ones, within
        its cap (below zero while it holds more than its cap)."""
        return min(pool.num_free, self.cap(pool, priority) - pool.held(priority))

    def borrowing(self, pool: KVBlockPool, victim: Request, requester: Request) -> bool:
        """Elastic caps: `victim`'s class holds more than its cap, and a higher class asks."""
        return (self.policy.elastic_caps and victim.priority > requester.priority
                and pool.held(victim.priority) > self.class_cap(pool, victim.priority))

    def make_room(self, worker: Worker, builder: StepBuilder, request: Request, need: int,
                   admitting: bool) -> bool:
        """Ensure `need` more blocks fit the pool and the request's class cap, preempting what the
        policy allows (lowest class first, newest first) only if that is enough."""
        pool = worker.pool
        short_pool = need - pool.num_free
        short_cap = pool.held(request.priority) + need - self.cap(pool, request.priority)
        if short_pool <= 0 and short_cap <= 0:
            return True
        victims = []
        for victim in self.victims(worker, builder, request, admitting):
            if short_pool <= 0 and short_cap <= 0:
                break
            if victim is request or victim.phase is not Phase.RUNNING or builder.is_scheduled(victim) \
                    or not victim.blocks \
                    or not (self.policy.may_preempt(request, victim, admitting)
                            or self.borrowing(pool, victim, request)):
                continue
            same_class = victim.priority == request.priority
            if short_pool <= 0 and not same_class:
                continue   # only the cap binds, and other classes' blocks do not count against it
            # What it gives back: with prefix caching, blocks others hold too stay held.
            to_pool, to_class = pool.releasable(victim.priority, victim.blocks)
            victims.append(victim)
            short_pool -= to_pool
            if same_class:
                short_cap -= to_class
        if short_pool > 0 or short_cap > 0:
            return False
        for victim in victims:
            self._preempt(worker, victim)
            builder.note_victim(victim)
        return True
