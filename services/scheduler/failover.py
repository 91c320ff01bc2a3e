"""Workers that join, leave or fail, as the batcher sees them (ContinuousBatcher inherits these).

A failed worker's sequences go back to the front of their class's queues with prompt + output so
far and are recomputed on another worker (as after a preemption); their client streams just go on.
Only a pool left with no worker for orphan_grace_s hands its requests back (UNAVAILABLE), so that
the router can move them to another pool.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from services.common.errors import ServiceError, unavailable
from services.common.kv_blocks import blocks_for_tokens, cap_blocks
from services.scheduler.cut_in_dispatch import CutInDispatch
from services.scheduler.planner import StepPlanner
from services.scheduler.policy import SchedulingPolicy
from services.scheduler.request import Phase, Request
from services.scheduler.worker_set import Worker, WorkerSet

log = logging.getLogger(__name__)

QUARANTINE_S = 30.0
QUARANTINE_MAX_S = 600.0


class WorkerChanges:
    # ContinuousBatcher's, as are `running`, `is_member` and `_finish`.
    pool_name: str
    workers: WorkerSet
    planner: StepPlanner
    policy: SchedulingPolicy
    cut_ins: CutInDispatch
    wakeup: asyncio.Event
    failovers: Counter
    orphan_grace_s: float
    quarantines: Counter        # address -> times its answers did not match its plans


    def add_link(self, link: Worker) -> None:
        """A worker joins the pool (registered, or found by DNS)."""
        self.workers.add(link)
        self.watch(link)
        self.wakeup.set()

    def watch(self, link: Worker) -> None:
        self.planner.add_worker(link.index)
        link.on_closed = self.link_closed

    def link_closed(self, link: Worker, reason: str) -> None:
        """The link went down, whenever that was: with a step in flight (which then fails too), or
        between two steps, when no step would ever fail to say so and its sequences would wait
        on a worker that is gone (and, once it reconnected, free their blocks into its new pool)."""
        if self.is_member(link):
            self.fail_worker(link, reason)

    def remove_link(self, link: Worker, reason: str) -> None:
        """A worker leaves the pool (gone from DNS): its sequences move to the others."""
        self.fail_worker(link, reason, why="left")
        self.workers.remove(link)
        self.planner.remove_worker(link.index)
        self.cut_ins.forget(link.index)

    def fail_worker(self, link: Worker, reason: str, why: str = "worker_failed") -> None:
        """The worker is gone: its blocks leave our books and every sequence it held goes back to
        the front of its class's queue with prompt + output so far, to be recomputed on another
        worker (as after a preemption); its client stream just continues. Only when the pool has
        no worker left for orphan_grace_s are requests handed back (UNAVAILABLE)."""
        running = list(self.running[link.index])
        if running:
            log.warning("%s; %d sequence(s) go back to the queue to be recomputed elsewhere",
                        reason, len(running))
        for request in running:
            self.planner.release(link, request)
            request.phase = Phase.WAITING
            request.failovers.append((time.perf_counter(), why, link.address))
            self.policy.add_front(request)
            self.failovers[why] += 1
        self.workers.forget(link)
        if not link.is_connected:   # a worker that comes back starts empty: nothing to release
            self.planner.to_release[link.index].clear()
            self.planner.passed.forget(link.index)
        self.wakeup.set()

    async def quarantine(self, link: Worker, reason: str) -> None:
        """A worker whose answer did not match its plan (answer_check.py) is failed like a dead
        one, its stream closed, and kept out of the pool for QUARANTINE_S, doubling each time
        it happens again (up to QUARANTINE_MAX_S): a broken worker is not trusted with new
        sequences at once, yet one that was restarted or mended comes back by itself."""
        self.quarantines[link.address] += 1
        seconds = min(QUARANTINE_MAX_S, QUARANTINE_S * 2 ** (self.quarantines[link.address] - 1))
        log.error("%s; out of pool %s for %.0f s", reason, self.pool_name, seconds)
        self.fail_worker(link, reason, why="broken_answer")
        link.hold_off(seconds)
        await link.close()

    def fail_waiting(self, predicate, failure: ServiceError) -> int:
        """End the queued requests `predicate` picks with `failure` (an adapter unloaded under
        them: no worker could ever take them, and each would block its lane's head)."""
        doomed = [r for lane in self.policy.lanes for r in list(self.policy.queue(lane)) if predicate(r)]
        for request in doomed:
            self._finish(request, failure)
        return len(doomed)

    def _hand_back_orphans(self, now: float) -> None:
        orphaned_for = self.workers.orphaned_for(now)
        if not len(self.policy):
            return
        if orphaned_for <= self.orphan_grace_s:
            self._hand_back_unservable(now)
            return
        waiting = [r for lane in self.policy.lanes for r in self.policy.queue(lane)]
        log.error("pool %s has had no worker to serve with for %.0f s: handing %d request(s) back",
                  self.pool_name, orphaned_for, len(waiting))
        for request in waiting:
            self._finish(request, unavailable(
                f"pool {self.pool_name} has no worker left (none for {orphaned_for:.0f} s)",
                reason="no_worker"))

    def _hand_back_unservable(self, now: float) -> None:
        """A lane's head that no worker of the pool could take (its adapter only on workers whose
        class cap cannot hold it, or on none that is up) holds every request behind it in its lane:
        after orphan_grace_s of that, it is handed back, as when the pool has no worker at all."""
        for lane in self.policy.lanes:
            head = self.policy.queue(lane).peek()
            if head is None or self._servable(head):
                if head is not None:
                    head.unservable_since = None
                continue
            since = head.unservable_since = head.unservable_since or now
            if now - since > self.orphan_grace_s:
                log.error("pool %s: no worker could serve %s for %.0f s: handed back", self.pool_name,
                          head.request_id, now - since)
                self._finish(head, unavailable(
                    f"no worker of pool {self.pool_name} can serve this request now (none that is up "
                    f"holds {'adapter ' + repr(head.lora) if head.lora else 'it'} within the class's "
                    f"KV cap, for {now - since:.0f} s)", reason="no_worker"))

    def _servable(self, request: Request) -> bool:
        """Some worker that takes new sequences holds its adapter and could hold all of it (a
        streaming one: its window's blocks), as admission.check_kv_cap counts."""
        whole = len(request.prompt_ids) + request.sampling.max_tokens
        share, window = self.policy.kv_cap(request.priority), request.window
        for link in self.workers:
            pool = link.pool
            if pool is None or not self.workers.admits(link) or (request.lora and request.lora not in link.adapters):
                continue
            need = blocks_for_tokens(whole, pool.block_size)
            if window is not None:
                need = min(need, window.max_blocks(self.planner.stream_chunk, pool.block_size))
            if need <= cap_blocks(pool.num_blocks, share):
                return True
        return False
