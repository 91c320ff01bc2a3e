"""SLA objectives judged from every request the router relays (not from samples).

Each finished request leaves one `Outcome` in its class's rolling window. Once a second the
router asks every objective of every `[[sla]]` contract for its value over its window (P99 of TTFT,
end-to-end or time per output token; or the share of requests served), and the alert book
(services/control/alerts.py) turns those values into alerts.

What counts against `success_rate`: requests that failed for the service's reasons (refused
because a queue or the KV cache was full, no worker, a worker or pool that failed, a deadline
passed). Client errors (bad input, an unknown model, a tenant's own rate limit or budget) and
cancellations are not the service's failures and are not counted at all.

Pure Python: no grpc, no clock of its own (callers pass `now`), so it is tested with made-up time.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.common.config import SlaConfig
from services.common.errors import ErrorKind, ServiceError
from services.common.percentile import percentile

ALL_TENANTS = "*"          # the tenant label of a class-wide objective
_SERVICE_FAULTS = (ErrorKind.EXHAUSTED, ErrorKind.UNAVAILABLE, ErrorKind.DEADLINE, ErrorKind.INTERNAL)


def counts_against_sla(error: ServiceError) -> bool:
    """A failure the service owns (see the module doc); a tenant's own limits are not."""
    return error.kind in _SERVICE_FAULTS and not error.reason.startswith(("rate_limit", "insufficient_quota"))


@dataclass(slots=True, frozen=True)
class Outcome:
    """One finished request, as the SLA sees it."""
    at: float                      # when it ended (seconds, the caller's clock)
    tenant: str
    served: bool                   # False: failed for the service's reasons
    ttft_ms: float | None = None   # None: no token streamed
    e2e_ms: float | None = None    # None: did not complete
    tpot_ms: float | None = None   # None: fewer than 2 tokens


@dataclass(slots=True, frozen=True)
class Objective:
    """One line of a contract: e.g. High, all tenants, ttft_p99_ms <= 200 over 60 s."""
    priority: str
    tenant: str                    # ALL_TENANTS or a tenant's name
    name: str                      # ttft_p99_ms | e2e_p99_ms | tpot_p99_ms | success_rate
    target: float
    contract: SlaConfig

    @property
    def labels(self) -> dict[str, str]:
        return {"priority": self.priority, "tenant": self.tenant, "objective": self.name}

    @property
    def higher_is_better(self) -> bool:
        return self.name == "success_rate"

    def breached(self, value: float) -> bool:
        return value < self.target if self.higher_is_better else value > self.target

    def met_with_margin(self, value: float) -> bool:
        """Met by the contract's hysteresis margin: the bar an open alert must clear to resolve."""
        margin = 1 - self.contract.hysteresis
        if self.higher_is_better:
            return 1 - value <= (1 - self.target) * margin     # errors well inside the budget
        return value <= self.target * margin

    def describe(self, value: float | None) -> str:
        who = "" if self.tenant == ALL_TENANTS else f" (tenant {self.tenant})"
        window = f"over the last {self.contract.window_s:g} s"
        if self.name == "success_rate":
            seen = "no verdict" if value is None else f"{value * 100:.2f}%"
            return f"{self.priority.capitalize()}{who} success rate is {seen} {window}, objective >= {self.target * 100:g}%"
        what = {"ttft_p99_ms": "TTFT P99", "e2e_p99_ms": "end-to-end P99", "tpot_p99_ms": "time per output token P99"}
        seen = "no verdict" if value is None else f"{value:.0f} ms"
        return f"{self.priority.capitalize()}{who} {what[self.name]} is {seen} {window}, objective <= {self.target:g} ms"


def objectives_of(contracts: list[SlaConfig]) -> list[Objective]:
    return [Objective(c.priority, c.tenant or ALL_TENANTS, name, float(target), c)
            for c in contracts for name, target in c.objectives().items()]


class SlaWindows:
    """The recent outcomes of each class, as long as its longest contract window needs."""

    def __init__(self, objectives: list[Objective]):
        self.keep_s: dict[str, float] = {}
        for objective in objectives:
            self.keep_s[objective.priority] = max(self.keep_s.get(objective.priority, 0.0),
                                                  objective.contract.window_s)
        self.outcomes: dict[str, deque[Outcome]] = {p: deque() for p in self.keep_s}

    def record(self, priority: str, outcome: Outcome) -> None:
        window = self.outcomes.get(priority)
        if window is not None:           # a class with no contract keeps nothing
            window.append(outcome)

    def trim(self, now: float) -> None:
        for priority, window in self.outcomes.items():
            oldest = now - self.keep_s[priority]
            while window and window[0].at < oldest:
                window.popleft()

    def measure(self, objective: Objective, now: float, minimum: int | None = None) -> tuple[float | None, int]:
        """(the objective's value over its window, requests counted); None when fewer than
        `minimum` (default: the contract's min_requests) ended in the window: too few to judge."""
        least = objective.contract.min_requests if minimum is None else minimum
        since = now - objective.contract.window_s
        outcomes = [o for o in self.outcomes[objective.priority] if o.at >= since
                    and (objective.tenant == ALL_TENANTS or o.tenant == objective.tenant)]
        if objective.name == "success_rate":
            if len(outcomes) < least:
                return None, len(outcomes)
            return sum(o.served for o in outcomes) / len(outcomes), len(outcomes)
        attribute = objective.name.removesuffix("_p99_ms") + "_ms"
        values = [v for o in outcomes if (v := getattr(o, attribute)) is not None]
        if len(values) < least:
            return None, len(values)
        return percentile(values, 0.99), len(values)
