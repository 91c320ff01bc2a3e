"""One worker's plan for one step, as the planner (services/scheduler/planner.py) fills it: the
sequences scheduled and their token counts, the KV blocks granted, the sequences announced and
released, and the bookkeeping a step leaves behind (tokens served per class and per tenant).
"""
from __future__ import annotations

from collections import Counter
from itertools import chain, repeat
from operator import attrgetter

from services.common.proto.qos.v1 import worker_pb2
from services.scheduler.request import Request
from services.scheduler.victims import VictimOrder

_SEQ_ID, _PRIORITY, _TENANT = (attrgetter(name) for name in ("seq_id", "priority", "tenant"))


class StepBuilder:
    """Collects one worker's plan for one step; finish() writes it into the StepPlan."""

    def __init__(self, step_id: int, budget: int, released: list[int], admits: bool = True):
        # packed_results: this scheduler reads the answer's tokens as packed lists (postprocess)
        self.plan = worker_pb2.StepPlan(step_id=step_id, released_seq_ids=released, packed_results=True)
        self.budget = budget
        self.admits = admits        # False: the worker drains, only its running sequences go on
        # The requests scheduled and their token counts, side by side (not as pairs: a step is
        # mostly decodes, added a slice at a time, and finish() reads each list whole).
        self.scheduled_requests: list[Request] = []
        self.scheduled_tokens: list[int] = []
        # Blocks granted, one entry per block (StepPlan.granted_seq_ids / granted_block_ids).
        self.granted_seq_ids: list[int] = []
        self.granted_block_ids: list[int] = []
        # The scheduled requests as a set, built only when asked (is_scheduled: a preemption looks
        # for victims), from the first `_set_covers` entries of `scheduled_requests`.
        self._scheduled_set: set[Request] = set()
        self._set_covers = 0
        # Highest class (smallest Priority value) preempted this step. Afterwards only strictly
        # higher classes are admitted: admitting the victim's peers would hand its blocks back.
        self.victim_floor: int | None = None
        # Planned while requests of the first-token lane waited for their first token: such a
        # step takes no cut-in (it would hold back the very first tokens cut-ins are for).
        self.first_tokens = False
        self.victims: VictimOrder | None = None     # running sequences in preemption order (room.py)
        self.slot_cursor = 0          # victims before it are preempted or scheduled already
        self.served: Counter = Counter()              # tokens scheduled per priority
        self.sequences_by_priority: Counter = Counter()   # sequences scheduled per priority
        # Tokens of prompt chunks (and other single items) scheduled per lane and tenant, not yet
        # charged to the tenant's share: charged before the lane's next admission.
        self.uncharged: dict[int, Counter] = {}
        # The decodes scheduled, as the slices add_decodes got, per lane: charged to their tenants
        # once the plan is sent (charge_decodes()).
        self.decodes_by_lane: dict[int, list[list[Request]]] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.scheduled_requests or self.plan.released_seq_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled_tokens)

    @property
    def scheduled(self) -> list[tuple[Request, int]]:
        """(request, tokens) for each sequence scheduled."""
        return list(zip(self.scheduled_requests, self.scheduled_tokens))

    def note_victim(self, request: Request) -> None:
        if self.victim_floor is None or request.priority < self.victim_floor:
            self.victim_floor = request.priority

    def may_admit(self, request: Request) -> bool:
        return self.admits and (self.victim_floor is None or request.priority < self.victim_floor)

    def grant(self, request: Request, blocks: list[int]) -> None:
        """Blocks for the request's block table on the worker (sent in finish())."""
        self.granted_seq_ids.extend(repeat(request.seq_id, len(blocks)))
        self.granted_block_ids.extend(blocks)

    def grant_each(self, requests: list[Request], blocks: list[int]) -> None:
        """One block each: blocks[i] for requests[i] (C-level, for a slice of decodes)."""
        self.granted_seq_ids.extend(map(_SEQ_ID, requests))
        self.granted_block_ids.extend(blocks)

    def add(self, request: Request, num_tokens: int) -> None:
        if request.new_blocks:
            self.grant(request, request.new_blocks)
            request.new_blocks = []
        self.scheduled_requests.append(request)
        self.scheduled_tokens.append(num_tokens)
        self.sequences_by_priority[request.priority] += 1
        self.budget -= num_tokens

    def add_decodes(self, requests: list[Request], lane: int, lane_is_class: bool) -> int:
        """One token each for running sequences whose next token fits in the blocks they hold,
        all of one lane, none of them preempted; returns the tokens scheduled. C-level maps and
        updates only: this is most of a step, kept free of a Python loop per sequence."""
        self.scheduled_requests.extend(requests)
        self.scheduled_tokens.extend(repeat(1, len(requests)))
        self.budget -= len(requests)
        if lane_is_class:
            self.served[lane] += len(requests)
            self.sequences_by_priority[lane] += len(requests)
        else:
            self.served.update(map(_PRIORITY, requests))
            self.sequences_by_priority.update(map(_PRIORITY, requests))
        slices = self.decodes_by_lane.get(lane)
        if slices is None:
            self.decodes_by_lane[lane] = [requests]
        else:
            slices.append(requests)
        return len(requests)

    def note_served(self, request: Request, tokens: int, lane: int) -> None:
        if tokens:
            self.served[request.priority] += tokens
            self.uncharged.setdefault(lane, Counter())[request.tenant] += tokens

    def charge_tenants(self, policy, lane: int) -> None:
        """Charge the lane's tenants for the prompt chunks scheduled so far, once per tenant:
        before the lane admits (each admission's prompt moves its tenant back in the order before
        the next one is chosen) and at the end of the plan."""
        tokens_by_tenant = self.uncharged.pop(lane, None)
        if tokens_by_tenant:
            policy.charge_tenants(lane, tokens_by_tenant)

    def scheduled_set(self) -> set[Request]:
        """The requests scheduled so far (kept up to date as asked, not at every add)."""
        scheduled = self.scheduled_requests
        if self._set_covers < len(scheduled):
            self._scheduled_set.update(scheduled[self._set_covers:])
            self._set_covers = len(scheduled)
        return self._scheduled_set

    def is_scheduled(self, request: Request) -> bool:
        return request in self.scheduled_set()

    def finish(self, released: list[int]) -> worker_pb2.StepPlan:
        self.plan.released_seq_ids.extend(released)
        self.plan.scheduled_seq_ids.extend(map(_SEQ_ID, self.scheduled_requests))
        self.plan.scheduled_num_tokens.extend(self.scheduled_tokens)
        self.plan.granted_seq_ids.extend(self.granted_seq_ids)
        self.plan.granted_block_ids.extend(self.granted_block_ids)
        return self.plan


def charge_decodes(policy, decodes_by_lane: dict[int, list[list[Request]]]) -> None:
    """Charge each lane's tenants for a plan's decodes (StepBuilder.decodes_by_lane), a token
    each. Called once the plan is on its way (ContinuousBatcher.settle_plans): counting the
    tenants of every decode took a fifth of a busy step's planning (256 running sequences), and
    the worker would wait for it. So an admission sees its lane's shares as of the steps before,
    not yet this step's decodes (a token per running sequence: the tenants' order lags a step)."""
    if policy.tenant_fairness:
        for lane, slices in decodes_by_lane.items():
            policy.charge_tenants(lane, Counter(map(_TENANT, chain.from_iterable(slices))))
