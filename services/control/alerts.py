"""SLA alerts: a breach opens an alert once it has held `for_seconds`; the alert resolves once the
objective has been met by the hysteresis margin for `resolve_seconds`. So one long breach is one
alert, and a value wobbling around the line (breached one second, met the next) opens none, or
keeps the one that is open, instead of spamming.

    ok --breached--> pending --held for_seconds--> FIRING --met with margin for resolve_seconds--> ok
          <--met-- (no alert)                            <--breached again: the clock restarts--

"No verdict" (fewer than min_requests in the window): an alert does not open on a handful of
requests. One that is open is judged on whatever requests the window holds: a few slow ones keep
it open, a few fast ones count as met; a window with no request at all counts as met (its
traffic has stopped: a Prometheus alert resolves when its series goes away).

Pure Python; `evaluate(now)` returns the transitions for the caller to log, export and post.
"""
from __future__ import annotations

import hashlib
import itertools
from collections import deque
from dataclasses import dataclass, field

from services.control.sla import Objective, SlaWindows

HISTORY = 100                  # resolved alerts kept for Router.Alerts


@dataclass(slots=True)
class Alert:
    objective: Objective
    state: str                 # firing | resolved
    observed: float            # the value that fired it, then the latest while firing
    breach_since: float        # when the breach began (pending)
    starts_at: float           # when it fired
    ends_at: float | None = None
    serial: int = 0
    silent: bool = False       # resolved because its traffic stopped (no request in the window)

    @property
    def fingerprint(self) -> str:
        """Stable per objective and firing (Alertmanager's `fingerprint`)."""
        key = "|".join(f"{k}={v}" for k, v in sorted(self.objective.labels.items()))
        return hashlib.sha256(f"{key}|{self.starts_at:.3f}".encode()).hexdigest()[:16]

    @property
    def summary(self) -> str:
        return self.objective.describe(self.observed)


@dataclass(slots=True)
class ObjectiveState:
    """Where one objective stands now."""
    objective: Objective
    observed: float | None = None
    requests: int = 0
    state: str = "ok"          # ok | pending | firing
    breach_since: float | None = None
    met_since: float | None = None
    alert: Alert | None = None
    transitions: int = 0       # alerts opened so far


@dataclass(slots=True)
class AlertBook:
    windows: SlaWindows
    states: list[ObjectiveState]
    resolved: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    serials: itertools.count = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def of(cls, objectives: list[Objective]) -> "AlertBook":
        return cls(SlaWindows(objectives), [ObjectiveState(o) for o in objectives])

    def evaluate(self, now: float) -> list[Alert]:
        """Judge every objective at `now`; returns the alerts that fired or resolved just now."""
        self.windows.trim(now)
        changed = []
        for s in self.states:
            s.observed, s.requests = self.windows.measure(s.objective, now)
            breached = s.observed is not None and s.objective.breached(s.observed)
            if s.state == "firing":
                changed += self._while_firing(s, breached, now)
            elif breached:
                s.breach_since = s.breach_since if s.state == "pending" else now
                s.state = "pending"
                if now - s.breach_since >= s.objective.contract.for_seconds:
                    changed.append(self._fire(s, now))
            else:
                s.state, s.breach_since = "ok", None
        return changed

    def _fire(self, s: ObjectiveState, now: float) -> Alert:
        s.state, s.met_since, s.transitions = "firing", None, s.transitions + 1
        s.alert = Alert(s.objective, "firing", s.observed, s.breach_since, now, serial=next(self.serials))
        return s.alert

    def _while_firing(self, s: ObjectiveState, breached: bool, now: float) -> list[Alert]:
        alert, contract = s.alert, s.objective.contract
        value = s.observed
        if value is None:            # too few for a verdict: judge the few there are, if any
            value, _ = self.windows.measure(s.objective, now, minimum=1)
        alert.silent = value is None
        if value is not None:
            alert.observed = value
        met = value is None or s.objective.met_with_margin(value)
        breached = breached or (value is not None and s.objective.breached(value))
        if breached or not met:
            s.met_since = None
            return []
        s.met_since = s.met_since if s.met_since is not None else now
        hold = contract.resolve_seconds if contract.resolve_seconds is not None else contract.for_seconds
        if now - s.met_since < hold:
            return []
        alert.state, alert.ends_at = "resolved", now
        self.resolved.append(alert)
        s.state, s.breach_since, s.met_since, s.alert = "ok", None, None, None
        return [alert]

    def open_alerts(self) -> list[Alert]:
        return [s.alert for s in self.states if s.alert is not None]
