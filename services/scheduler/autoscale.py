"""How many workers a pool wants: `desired_workers`, judged once a second from the scheduler's own
state, exported as `qos_desired_workers{pool}` and in PoolStats. Something else acts on it:
`qos-serve up --autoscale` locally (services/local/autoscaler.py), KEDA on Kubernetes.

The rule (limits and thresholds from `[pools.autoscale]`):

- one more worker (up to max_workers) when any of these holds:
  - more than `scale_out_high_backlog` High requests wait (the reference design's rule: High
    queue > 100 → add capacity);
  - requests wait and High's TTFT P99 over the last minute (at least 10 requests) is above
    `high_ttft_p99_ms` (default: the High SLA's objective); with nothing waiting, slow first
    tokens are not a queue that another worker would shorten, and the samples of a burst that has
    ended must not hold the pool at its peak for a minute;
  - KV blocks in use have stayed above `kv_high` of the pool's total for `kv_high_for_s`;
- one fewer (down to min_workers) when the load, (running + waiting) / (workers × max_running),
  has stayed below `scale_in_below` for `scale_in_after_s` with no High request waiting;
- after any change, no scale-out for `scale_out_cooldown_s` and no scale-in for
  `scale_in_cooldown_s`: a new worker takes seconds to load its model and show its effect, and
  deciding again before that would overshoot (out) or flap (in).

Pure Python; `update(signals, now)` is called with the caller's clock.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.common.config import AutoscaleConfig
from services.common.percentile import percentile

TTFT_WINDOW_S = 60.0
TTFT_MIN_SAMPLES = 10


@dataclass(slots=True, frozen=True)
class PoolSignals:
    workers: int                # serving now (connected, not draining)
    high_waiting: int
    waiting: int                # all classes
    running: int
    max_running: int            # per worker
    kv_used: int
    kv_total: int


class ScaleAdvisor:
    def __init__(self, config: AutoscaleConfig, min_workers: int, max_workers: int,
                 high_ttft_objective_ms: float | None = None):
        self.config = config
        self.min_workers, self.max_workers = min_workers, max(min_workers, max_workers)
        self.high_ttft_ms = config.high_ttft_p99_ms if config.high_ttft_p99_ms is not None else high_ttft_objective_ms
        self.desired = min_workers
        self.reason = "at the minimum since start"
        self.changed_at: float | None = None
        self.kv_high_since: float | None = None
        self.idle_since: float | None = None
        self.high_ttft: deque[tuple[float, float]] = deque()

    def observe_high_ttft(self, ttft_ms: float, now: float) -> None:
        self.high_ttft.append((now, ttft_ms))

    def _high_ttft_p99(self, now: float) -> float | None:
        while self.high_ttft and self.high_ttft[0][0] < now - TTFT_WINDOW_S:
            self.high_ttft.popleft()
        if len(self.high_ttft) < TTFT_MIN_SAMPLES:
            return None
        return percentile((t for _, t in self.high_ttft), 0.99)

    def _since(self, condition: bool, since: float | None, now: float) -> float | None:
        return (since if since is not None else now) if condition else None

    def pressure(self, s: PoolSignals, now: float) -> str | None:
        """Why the pool needs one more worker now, or None."""
        c = self.config
        if s.high_waiting > c.scale_out_high_backlog:
            return f"High backlog {s.high_waiting} > {c.scale_out_high_backlog}"
        p99 = self._high_ttft_p99(now) if self.high_ttft_ms is not None and s.waiting else None
        if p99 is not None and p99 > self.high_ttft_ms:
            return f"High TTFT P99 {p99:.0f} ms > {self.high_ttft_ms:g} ms"
        kv_share = s.kv_used / s.kv_total if s.kv_total else 0.0
        self.kv_high_since = self._since(kv_share > c.kv_high, self.kv_high_since, now)
        if self.kv_high_since is not None and now - self.kv_high_since >= c.kv_high_for_s:
            return f"KV use {kv_share:.0%} > {c.kv_high:.0%} for {now - self.kv_high_since:.0f} s"
        return None

    def update(self, s: PoolSignals, now: float) -> int:
        c = self.config
        since_change = float("inf") if self.changed_at is None else now - self.changed_at
        why_out = self.pressure(s, now)
        capacity = max(1, s.workers) * s.max_running
        load = (s.running + s.waiting) / capacity
        idle = why_out is None and s.high_waiting == 0 and load < c.scale_in_below
        self.idle_since = self._since(idle, self.idle_since, now)
        if why_out and self.desired < self.max_workers and since_change >= c.scale_out_cooldown_s:
            self._change(self.desired + 1, why_out, now)
        elif (self.idle_since is not None and now - self.idle_since >= c.scale_in_after_s
              and self.desired > self.min_workers and since_change >= c.scale_in_cooldown_s):
            self._change(self.desired - 1, f"load {load:.0%} < {c.scale_in_below:.0%} for "
                         f"{now - self.idle_since:.0f} s", now)
            self.idle_since = now          # the next step down waits as long again
        return self.desired

    def _change(self, desired: int, reason: str, now: float) -> None:
        self.desired, self.reason, self.changed_at = desired, reason, now
