"""What every simulated pool shares (bench/sim/fast_pool.py, bench/sim/step_pool.py): its
accelerator, the counters its stats report carries (the same PoolReport the router's latency
model reads from a real scheduler), and what happens to a request at its first and last token."""
from __future__ import annotations

from collections import Counter, deque

from bench.sim.accelerators import Accelerator
from bench.sim.workload import SimRequest
from services.common.percentile import percentile
from services.common.priority import ORDER
from services.router.latency_model import PoolReport
from services.router.routing import PoolLoad

RECENT_TTFT = 200              # as the real scheduler's ttft_p90_ms: over the last 200 requests


class PoolBase:
    def __init__(self, name: str, accelerator: Accelerator):
        self.name = name
        self.accelerator = accelerator
        self.busy_until: float | None = None   # end of the step(s) in flight; None: idle
        self.busy_s = 0.0                      # time spent computing, for utilisation
        self.step_seconds = 0.0                # as PoolStats.step_seconds
        self.steps = 0
        self.step_tokens = 0
        self.step_kv_tokens = 0
        self.served: Counter = Counter()
        self.recomputed: Counter = Counter()
        self.preemptions = 0
        self.waiting_tokens: Counter = Counter()
        self.recent_ttft_ms: deque[float] = deque(maxlen=RECENT_TTFT)
        self.finished: list[SimRequest] = []
        self._last_busy = 0.0
        self._last_report_at = 0.0
        self.pace = None                       # t -> step-time factor (bench/sim/pace.py); None: 1

    def next_event(self) -> float | None:
        """When the pool's next event (the end of its step) comes; None: idle."""
        return self.busy_until

    def step_s(self, tokens: float, kv_tokens: float, now: float) -> float:
        """One step's duration on this pool's accelerator, at the machine's pace at `now`."""
        seconds = self.accelerator.step_ms(tokens, kv_tokens) / 1000
        return seconds * self.pace(now) if self.pace is not None else seconds

    # --- what subclasses provide -------------------------------------------------------------------

    def waiting(self, p: int) -> int: ...
    def prefill_left(self, p: int) -> int: ...
    def running(self, p: int) -> int: ...
    def kv_used(self) -> int: ...
    def weights(self) -> tuple: ...
    def kv_by_class(self) -> tuple: ...
    def kv_caps(self) -> tuple: ...

    # --- events of a request -----------------------------------------------------------------------

    def first_token(self, request: SimRequest, now: float) -> None:
        request.first_token_at = now
        self.recent_ttft_ms.append((now - request.arrival) * 1000)

    def finish(self, request: SimRequest, now: float) -> None:
        request.finished_at = now
        self.finished.append(request)

    # --- the stats stream --------------------------------------------------------------------------

    def report(self, now: float, with_ttft: bool = True) -> PoolLoad:
        """The pool's stats as the router caches them (services/router/pools.py pool_load)."""
        acc = self.accelerator
        elapsed = now - self._last_report_at
        busy = self.busy_s - self._last_busy
        self._last_report_at, self._last_busy = now, self.busy_s
        waiting = tuple(self.waiting(p) for p in ORDER)
        report = PoolReport(
            step_seconds=self.step_seconds, worker_steps=self.steps, step_tokens=self.step_tokens,
            step_kv_tokens=self.step_kv_tokens, steps=self.steps, finished=len(self.finished), at_s=now,
            kv_capacity=acc.kv_tokens, kv_by_class=self.kv_by_class(), kv_caps=self.kv_caps(), kv_tokens=self.kv_used(), waiting=waiting, waiting_tokens=tuple(self.prefill_left(p) for p in ORDER),
            running=tuple(self.running(p) for p in ORDER), weights=self.weights(), workers=1,
            max_step_tokens=acc.max_step_tokens, max_running=acc.max_running)
        return PoolLoad(healthy=True, queued=sum(waiting), free_kv=1.0 - self.kv_used() / acc.kv_tokens,
                        ttft_ms=percentile(self.recent_ttft_ms, 0.9) if with_ttft else 0.0,
                        utilization=min(busy / elapsed, 1.0) if elapsed > 0 else 0.0, report=report)
