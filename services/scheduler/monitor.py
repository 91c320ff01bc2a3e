"""The resource monitor: lowers Low's weight while the pool is saturated, restores it after.

Fed after every step with the worker's utilization (share of recent time spent computing) and the
pool's free KV share (exact: the scheduler owns the blocks). Under pressure (utilization > 90% and
free KV < 10%) Low's weight drops 2 -> 1, so High and Medium get more of each step; once
utilization falls below 50% it goes back to 2. Every change is logged and kept for Stats.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from services.common.priority import LOW
from services.scheduler.policy import SchedulingPolicy

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class MonitorThresholds:
    busy_utilization: float = 0.9
    low_free_kv: float = 0.1
    idle_utilization: float = 0.5
    low_weight_under_pressure: float = 1.0


@dataclass(slots=True, frozen=True)
class WeightChange:
    at: float                 # time.time()
    priority: int
    old: float
    new: float
    utilization: float
    free_kv: float


class ResourceMonitor:
    def __init__(self, policy: SchedulingPolicy, thresholds: MonitorThresholds | None = None):
        self.policy = policy
        self.thresholds = thresholds or MonitorThresholds()
        self.normal_low_weight = policy.weights()[LOW]
        self.changes: deque[WeightChange] = deque(maxlen=100)
        self.utilization = 0.0
        self.free_kv = 1.0

    def observe(self, utilization: float, free_kv: float) -> None:
        self.utilization, self.free_kv = utilization, free_kv
        t = self.thresholds
        current = self.policy.weights()[LOW]
        if utilization > t.busy_utilization and free_kv < t.low_free_kv:
            target = min(t.low_weight_under_pressure, self.normal_low_weight)
        elif utilization < t.idle_utilization:
            target = self.normal_low_weight
        else:
            return   # between the thresholds: keep what we have (hysteresis)
        if target != current:
            self.policy.set_weight(LOW, target)
            self.changes.append(WeightChange(time.time(), LOW, current, target, utilization, free_kv))
            log.warning("resource monitor: Low weight %g -> %g (utilization %.0f%%, free KV %.0f%%)",
                        current, target, utilization * 100, free_kv * 100)
