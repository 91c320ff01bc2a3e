"""Cut-ins: plans the worker runs inside the step in flight, at a pause in its forward pass.

A High request that arrives while a long step computes (a 128-token chunk of a 4,000-token Low
prompt, say) would wait for the rest of that step before its own could start. The scheduler
sends such a request's first step as a cut-in (StepPlan.cut_in: new sequences only, nothing the
step in flight touches), and the engine thread runs it at the next pause of the step in flight
(between two layers, or after an attention call inside one: Engine.step's `pause`), then goes on
with that step: the wait is a fraction of a layer's time instead of a step's.

The event loop offers cut-ins (`offer`) as they arrive; the engine thread opens the step it is
about to compute to them (`host`), takes what arrived at each pause (`take`) and, when
the step is over, closes it (`close`), taking what arrived too late to nest: those run right
after the step. A cut-in is also taken while a step is on its way (`expect`: the event loop
queued a plan that has not reached the engine yet): the scheduler sent it into that step, and
refused it would have queued behind the whole step (under the full-scale burst, High cut-ins
that reached the worker in that gap waited up to 18 ms to start, against a median of ~1 ms for
those nested). A cut-in offered with no step open or on its way is refused and queues like any
plan (it then runs as a step of its own, which nothing cuts into).
"""
from __future__ import annotations

import threading
from collections import Counter

from services.common.proto.qos.v1 import worker_pb2
from services.common.step import StepBatch
from services.worker.sequences import PlanError


class CutIns:
    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        self._lock = threading.Lock()
        self._host: StepBatch | None = None
        self._waiting: list[worker_pb2.StepPlan] = []
        self._coming = 0        # plans queued for the engine that will host (or close) a step
        # The open step's sequence ids and blocks, built at its first check (engine thread).
        self._busy: tuple[set[int], set[int]] | None = None

    def host(self, batch: StepBatch) -> None:
        """The engine thread computes `batch` next; cut-ins may run inside it (not while it uses a
        LoRA adapter: a cut-in must not move adapters on the device under it)."""
        if batch.sequences and not any(s.lora for s in batch.sequences):
            with self._lock:
                self._host = batch
                self._busy = None

    def expect(self) -> None:
        """A plan that is not a cut-in was queued for the engine (event loop): cut-ins offered from
        now on wait for its step (its first pause, or right after it)."""
        with self._lock:
            self._coming += 1

    def step_over(self) -> None:
        """The engine thread is done with a plan `expect` announced (once per such plan, before
        closing its step): the cut-ins still waiting run right after it."""
        with self._lock:
            # Never below 0: a plan run after reset() (the stream ended while the engine computed
            # it) or run without being read from a stream (tests) was not announced.
            self._coming = max(0, self._coming - 1)

    def reset(self) -> None:
        """The scheduler's stream ended: no step is on its way any more."""
        with self._lock:
            self._coming = 0
            self._waiting = []

    def offer(self, plan: worker_pb2.StepPlan) -> bool:
        """A cut-in plan from the scheduler (event loop): True when the open step, or the one on
        its way, will run it."""
        if any(new.lora for new in plan.new_sequences):
            return False
        with self._lock:
            if self._host is None and not self._coming:
                return False
            self._waiting.append(plan)
            return True

    def take(self) -> list[worker_pb2.StepPlan]:
        """Cut-ins offered since the last call (engine thread, at a pause of the open step; none
        while the step hosts nothing, such as one with a LoRA adapter: they run after it)."""
        if not self._waiting or self._host is None:    # the common case, without the lock
            return []
        with self._lock:
            waiting, self._waiting = self._waiting, []
        return waiting

    def close(self) -> list[worker_pb2.StepPlan]:
        """The open step is over: no more cut-ins; returns those it did not run."""
        with self._lock:
            self._host = None
            waiting, self._waiting = self._waiting, []
        return waiting

    def check(self, plan: worker_pb2.StepPlan) -> None:
        """Raises PlanError when the cut-in touches a sequence of the open step or a block one of
        them holds (running it there would corrupt that step). Engine thread."""
        host = self._host
        if host is None:
            return
        if self._busy is None:     # once per open step, not per cut-in: thousands of blocks at long contexts
            self._busy = ({work.seq_id for work in host.sequences},
                          {block for work in host.sequences for block in work.block_table})
        busy, held = self._busy
        touched = (busy.intersection(plan.scheduled_seq_ids) or busy.intersection(plan.granted_seq_ids)
                   or busy.intersection(plan.released_seq_ids)
                   or busy.intersection(new.seq_id for new in plan.new_sequences))
        if touched:
            raise PlanError(f"cut-in step {plan.step_id} touches sequence {min(touched)} of the step in flight")
        # A new sequence's first blocks may be cached ones (prefix caching): it only reads them,
        # and so may the step in flight. Only the blocks it writes must be its own.
        read_only = {new.seq_id: new.cached_tokens // self.block_size for new in plan.new_sequences
                     if new.cached_tokens}
        granted = plan.granted_block_ids
        if read_only:
            index = Counter()
            writes = []
            for seq_id, block in zip(plan.granted_seq_ids, granted):
                index[seq_id] += 1
                if index[seq_id] > read_only.get(seq_id, 0):
                    writes.append(block)
            granted = writes
        shared = held.intersection(granted)
        if shared:
            raise PlanError(f"cut-in step {plan.step_id} grants block {min(shared)}, held by a sequence "
                            "of the step in flight")
