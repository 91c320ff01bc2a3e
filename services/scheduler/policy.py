"""Scheduling policies: which requests wait where, who gets each step's tokens, KV caps, and who
may preempt whom. One small interface, a class per policy, made by name with create_policy().

    fcfs  one lane in arrival order; no caps; priorities ignored (the benchmark's baseline)
    qos   a lane per priority, weighted fair queueing over served tokens (5:3:2), KV caps per class
          (High 100%, Medium 70%, Low 30%), High preempts lower classes

The batcher plans a step lane by lane: it asks `pick_lane` which lane's next item gets tokens,
schedules it, and reports the tokens with `charge`.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.common.config import KV_CAP_MODES
from services.common.priority import HIGH, LOW, MEDIUM, ORDER, priority_name
from services.scheduler.request import Request
from services.scheduler.tenant_queue import TenantQueue

log = logging.getLogger(__name__)
TENANT_SWEEP_S = 1.0      # how often idle tenants are looked for (a lane's walk: its busy tenants at most)


@dataclass(slots=True)
class QoSSettings:
    weights: dict[int, float] = field(default_factory=lambda: {HIGH: 5.0, MEDIUM: 3.0, LOW: 2.0})
    kv_caps: dict[int, float] = field(default_factory=lambda: {HIGH: 1.0, MEDIUM: 0.7, LOW: 0.3})
    tenant_fairness: bool = True      # inside a class, tenants share by weight (tenant_queue.py)
    # "strict": a class never holds more than its cap. "elastic": it may borrow beyond it while no
    # other class waits; a higher class that needs blocks takes them back by preempting it.
    kv_cap_mode: str = "strict"
    # A High request that can start at once (blocks and a running slot free, prompt within one
    # step) while a worker computes a step: its first step runs inside that one, at a pause in
    # its forward pass (a cut-in: services/worker/cut_ins.py), instead of after it.
    high_cut_in: bool = True
    # Running slots beyond max_running that those cut-ins may take, as a share of it (at least one
    # while > 0): a cut-in cannot preempt (any running sequence may be in the step in flight), and
    # under a burst every slot is taken. 0: none beyond max_running.
    high_cut_in_slots: float = 0.25

    def __post_init__(self) -> None:
        if self.kv_cap_mode not in KV_CAP_MODES:
            raise ValueError(f"kv_cap_mode must be one of {', '.join(KV_CAP_MODES)}, got {self.kv_cap_mode!r}")
        if not 0 <= self.high_cut_in_slots <= 1:
            raise ValueError(f"high_cut_in_slots must be a share of max_running in 0..1, "
                             f"got {self.high_cut_in_slots!r}")
        for p in ORDER:
            if not self.weights.get(p, 0) > 0:
                raise ValueError(f"weight of {priority_name(p)} must be > 0")
            if not 0 < self.kv_caps.get(p, 0) <= 1:
                raise ValueError(f"kv cap of {priority_name(p)} must be in (0, 1]")


class SchedulingPolicy(ABC):
    name: str
    admits_by_priority = True     # new requests are tokenized and queued High first (intake.py)

    def __init__(self, tenant_fairness: bool = False) -> None:
        self.tenant_fairness = tenant_fairness
        self._queues: dict[int, TenantQueue] = {lane: TenantQueue(tenant_fairness) for lane in self.lanes}
        # Requests waiting per class, counted as they come and go: every request's admission
        # asks (queue limits, stats), and a flood's 800 queued requests walked for each of 800
        # admissions was a second's intake spent counting.
        self._waiting: Counter = Counter()
        # ... and per (class, tenant), with fairness on: a full queue refuses the tenants holding
        # their share of it, not the others (admission.check_queue). Only tenants with requests
        # waiting are kept; _tenants_waiting counts them per class.
        self._waiting_by_tenant: Counter = Counter()
        self._tenants_waiting: Counter = Counter()
        # A request's lane follows from its class alone; a table, since planning looks it up for
        # every running sequence of every step.
        self.lane_by_priority: dict[int, int] = {p: self._lane_of_priority(p) for p in ORDER}
        self.lane_is_class = all(lane == p for p, lane in self.lane_by_priority.items())
        self._tenants_looked_at: float | None = None     # forget_idle_tenants' last time

    # --- lanes and waiting queues -----------------------------------------------------------

    @property
    @abstractmethod
    def lanes(self) -> tuple[int, ...]:
        """Lane ids in tie-break order (first wins a tie)."""

    @abstractmethod
    def _lane_of_priority(self, priority: int) -> int: ...

    def lane_of(self, request: Request) -> int:
        return self.lane_by_priority[request.priority]

    def lane_of_priority(self, priority: int) -> int:
        return self.lane_by_priority[priority]

    def share(self, lane: int, backlogged: set[int]) -> float:
        """Fraction of the token rate `lane` gets while `backlogged` lanes compete."""
        weights = self.weights_by_lane()
        return weights[lane] / sum(weights[l] for l in backlogged)

    def weights_by_lane(self) -> dict[int, float]:
        return {lane: 1.0 for lane in self.lanes}

    def add(self, request: Request) -> None:
        self._queues[self.lane_of(request)].append(request)
        self._count(request, 1)

    def add_front(self, request: Request) -> None:
        """A preempted request: first in its lane."""
        self._queues[self.lane_of(request)].appendleft(request)
        self._count(request, 1)

    def remove(self, request: Request) -> None:
        self._queues[self.lane_of(request)].remove(request)
        self._count(request, -1)

    def _count(self, request: Request, change: int) -> None:
        self._waiting[request.priority] += change
        if self.tenant_fairness:
            key = (request.priority, request.tenant)
            held = self._waiting_by_tenant[key] + change
            if held:
                self._waiting_by_tenant[key] = held
            else:
                del self._waiting_by_tenant[key]
            if held == (1 if change > 0 else 0):        # the tenant began or stopped waiting
                self._tenants_waiting[request.priority] += change

    def tenant_waiting(self, priority: int, tenant: str) -> tuple[int, int]:
        """With fairness on: the tenant's requests waiting in the class, and the tenants waiting
        there counting this one."""
        held = self._waiting_by_tenant.get((priority, tenant), 0)
        return held, self._tenants_waiting[priority] + (0 if held else 1)

    def queue(self, lane: int) -> TenantQueue:
        """The lane's waiting requests; `.peek()` is the one to admit next."""
        return self._queues[lane]

    def charge_tenants(self, lane: int, tokens_by_tenant: dict[str, int]) -> None:
        """Tokens were served to requests of these tenants in `lane`: their shares inside the
        lane move on."""
        self._queues[lane].charge(tokens_by_tenant)

    def forget_idle_tenants(self, now: float, running: Iterable[Iterable[Request]]) -> None:
        """Each lane forgets its tenants idle for TENANT_IDLE_S (tenant_queue.py); `running`: the
        requests running now, by worker (`now`: any clock, the batcher's). Looked at once a
        second at most."""
        if not self.tenant_fairness or (self._tenants_looked_at is not None
                                        and now - self._tenants_looked_at < TENANT_SWEEP_S):
            return
        self._tenants_looked_at = now
        busy: dict[int, set[str]] = {lane: set() for lane in self.lanes}
        lane_by_priority = self.lane_by_priority
        for requests in running:
            for request in requests:
                busy[lane_by_priority[request.priority]].add(request.tenant)
        for lane, queue in self._queues.items():
            queue.forget_idle(now, busy[lane])

    def waiting(self, priority: int) -> int:
        return self._waiting[priority]

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    # --- sharing a step -----------------------------------------------------------------------

    @abstractmethod
    def pick_lane(self, candidates: set[int]) -> tuple[int, float]:
        """Among lanes that have work this step, the one whose items get tokens next, and how many
        tokens it may take before the choice is made again (it always gets at least one item)."""

    def charge(self, lane: int, tokens: int) -> None:
        """`tokens` were scheduled for `lane`."""

    def first_token_lane(self) -> int | None:
        """A lane whose requests waiting for their first token go ahead of the sharing order this
        step (the planner checks that it has such requests), or None."""
        return None

    cut_in = False                    # first-token lane admissions may run inside the step in flight

    def cut_in_slots(self, max_running: int) -> int:
        """Running slots beyond `max_running` that cut-ins may take."""
        return 0

    def backlog_changed(self, backlogged: set[int], now: float = 0.0) -> None:
        """Lanes with work at the start of a step at `now` (seconds, any clock): for virtual-time
        bookkeeping."""

    # --- memory ---------------------------------------------------------------------------------

    def kv_cap(self, priority: int) -> float:
        """Largest share of a worker's KV blocks the class may hold."""
        return 1.0

    elastic_caps = False      # caps may be exceeded while no other class waits (QoS "elastic")

    @abstractmethod
    def may_preempt(self, requester: Request, victim: Request, admitting: bool) -> bool:
        """Whether `victim` (running, not scheduled this step) may lose its blocks for `requester`."""

    def admission_may_preempt(self, requester: Request) -> bool:
        """False when `requester`, waiting for admission, may preempt nobody (a quick answer that
        spares planning a walk over every running sequence)."""
        return True

    def lane_may_displace(self, lane: int) -> bool:
        """False when no request waiting in `lane` may preempt a running sequence to get a running
        slot (admission_may_preempt is False for all of them): planning then does not look for
        the lane's next request while the worker's slots are all taken."""
        return True

    # True when a request may only ever preempt its own class or lower ones (never a higher
    # class): planning then looks for victims among those classes only (room.py).
    preempts_by_class = False

    def weights(self) -> dict[int, float]:
        return {p: 1.0 for p in ORDER}

    def set_weight(self, priority: int, weight: float) -> None:
        raise NotImplementedError(f"policy {self.name} has no weights")


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: one lane, running work before admissions, no caps."""
    name = "fcfs"
    admits_by_priority = False
    ONLY_LANE = 0

    @property
    def lanes(self) -> tuple[int, ...]:
        return (self.ONLY_LANE,)

    def _lane_of_priority(self, priority: int) -> int:
        return self.ONLY_LANE

    def pick_lane(self, candidates: set[int]) -> tuple[int, float]:
        return self.ONLY_LANE, float("inf")

    def admission_may_preempt(self, requester: Request) -> bool:
        return False

    def lane_may_displace(self, lane: int) -> bool:
        return False

    def may_preempt(self, requester: Request, victim: Request, admitting: bool) -> bool:
        # Only to let running work progress, taking from the most recent arrivals.
        return not admitting and victim.seq_id > requester.seq_id


class QoSPolicy(SchedulingPolicy):
    """Weighted fair queueing over served tokens, per-class KV caps, preemption by priority.

    Each class has a virtual time, advanced by tokens served / weight; each slice of a step's
    budget goes to the backlogged class with the smallest. A class that was idle re-enters at the
    smallest virtual time among the backlogged ones (after a spell with nothing backlogged: where
    service stood then), so idle time banks no credit and service alone is no debt."""
    name = "qos"
    MIN_QUANTUM_TOKENS = 16
    # High goes ahead for a first token only while it is no more than this many High tokens ahead
    # of the least-served backlogged class: bounded debt, so that the 5:3:2 shares still hold over
    # a window and High's own decodes never wait long for the others to catch up.
    AHEAD_LIMIT_TOKENS = 512
    # ... or up to this many while High's share of the tokens served over the last window is
    # below its weight's share among the classes backlogged now: the debt is then within what
    # High's weight entitles it to over that window, so a long prompt (a 1,000-token chat
    # history) goes ahead for its whole first token while 5:3:2 holds over every window.
    AHEAD_MAX_TOKENS = 1024
    SHARE_WINDOW_S = 10.0

    def __init__(self, settings: QoSSettings | None = None):
        settings = settings or QoSSettings()
        super().__init__(settings.tenant_fairness)
        self.settings = settings
        self._weights = dict(self.settings.weights)
        self.virtual_time = {p: 0.0 for p in ORDER}
        self._backlogged: set[int] = set()
        self._system_vtime = 0.0     # the least virtual time among the backlogged, when last seen
        # (time, High's tokens, all tokens) served by the start of each step of the last window
        self._window: deque[tuple[float, int, int]] = deque()
        self.served = {p: 0 for p in ORDER}

    @property
    def lanes(self) -> tuple[int, ...]:
        return ORDER

    def _lane_of_priority(self, priority: int) -> int:
        return priority

    def backlog_changed(self, backlogged: set[int], now: float = 0.0) -> None:
        served, window = self.served, self._window
        window.append((now, served[HIGH], served[HIGH] + served[MEDIUM] + served[LOW]))
        while now - window[0][0] > self.SHARE_WINDOW_S:
            window.popleft()
        vtime = self.virtual_time
        returning = backlogged - self._backlogged
        if returning:
            # A class returns at the system's virtual time: where the classes still backlogged
            # stand, or, after a spell with nothing to do, where service stood when it stopped.
            # So time away banks no credit, and a class that was served alone (or went ahead)
            # while nobody else waited owes nothing for it.
            staying = backlogged - returning
            floor = min(vtime[p] for p in staying) if staying else self._system_vtime
            for p in returning:
                vtime[p] = max(vtime[p], floor)
        if backlogged:
            self._system_vtime = min(vtime[p] for p in backlogged)
        self._backlogged = set(backlogged)

    def pick_lane(self, candidates: set[int]) -> tuple[int, float]:
        # Smallest virtual time first; High wins ties (enum order). The lane keeps the turn until
        # its virtual time passes the runner-up's: tokens = gap x weight.
        vtime = self.virtual_time
        lane = runner_up = None
        for p in candidates:          # at most three: a loop beats sorting with a key
            if lane is None or (vtime[p], p) < (vtime[lane], lane):
                lane, runner_up = p, lane
            elif runner_up is None or (vtime[p], p) < (vtime[runner_up], runner_up):
                runner_up = p
        if runner_up is None:
            return lane, float("inf")
        gap = (vtime[runner_up] - vtime[lane]) * self._weights[lane]
        # A minimum quantum keeps lanes from alternating token by token when their virtual times
        # are close (cheaper planning); long-run shares are unchanged.
        return lane, max(gap, self.MIN_QUANTUM_TOKENS)

    def charge(self, lane: int, tokens: int) -> None:
        self.virtual_time[lane] += tokens / self._weights[lane]
        self.served[lane] += tokens

    def first_token_lane(self) -> int | None:
        # A High request waiting for its first token: High's work goes first in the step (its
        # tokens are charged to its virtual time all the same, so the others get them back over
        # the next steps), within a bounded lead (below).
        others = [self.virtual_time[p] for p in self._backlogged if p != HIGH]
        lead = (self.virtual_time[HIGH] - min(others)) * self._weights[HIGH] if others else 0.0
        if lead <= self.AHEAD_LIMIT_TOKENS:
            return HIGH
        return HIGH if lead <= self.AHEAD_MAX_TOKENS and self._high_under_its_share() else None

    def _high_under_its_share(self) -> bool:
        """High was served less than its weight's share (among the classes backlogged now) of
        the tokens served over the last window."""
        if not self._window:
            return True
        _, high_before, all_before = self._window[0]
        served = self.served
        tokens = served[HIGH] + served[MEDIUM] + served[LOW] - all_before
        if tokens <= 0:
            return True
        weights = self._weights
        fair = weights[HIGH] / sum(weights[p] for p in self._backlogged | {HIGH})
        return served[HIGH] - high_before < fair * tokens

    @property
    def elastic_caps(self) -> bool:
        return self.settings.kv_cap_mode == "elastic"

    @property
    def cut_in(self) -> bool:
        return self.settings.high_cut_in

    def cut_in_slots(self, max_running: int) -> int:
        share = self.settings.high_cut_in_slots
        return max(1, int(max_running * share)) if share > 0 else 0

    def kv_cap(self, priority: int) -> float:
        return self.settings.kv_caps[priority]

    preempts_by_class = True

    def admission_may_preempt(self, requester: Request) -> bool:
        return requester.priority == HIGH

    def lane_may_displace(self, lane: int) -> bool:
        return lane == self.lane_by_priority[HIGH]        # a lane per class

    def may_preempt(self, requester: Request, victim: Request, admitting: bool) -> bool:
        if victim.priority > requester.priority:        # enum order: High=1 < Medium=2 < Low=3
            return requester.priority == HIGH or not admitting
        # Within a class, only so that running work progresses, taking from the newest.
        return (not admitting and victim.priority == requester.priority
                and victim.seq_id > requester.seq_id)

    def weights(self) -> dict[int, float]:
        return dict(self._weights)

    def weights_by_lane(self) -> dict[int, float]:
        return dict(self._weights)

    def set_weight(self, priority: int, weight: float) -> None:
        if weight <= 0:
            raise ValueError("weights must be > 0")
        self._weights[priority] = weight


def create_policy(name: str, settings: QoSSettings | None = None) -> SchedulingPolicy:
    if name == FCFSPolicy.name:
        return FCFSPolicy()
    if name == QoSPolicy.name:
        return QoSPolicy(settings)
    raise ValueError(f"unknown scheduling policy {name!r}; known: fcfs, qos")
