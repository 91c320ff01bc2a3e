"""One pool in virtual time, for the scheduling-quality benchmarks (bench/qos_virtual.py,
bench/tenant_service.py): the real scheduler (bench/sim/step_pool.py: ContinuousBatcher with its
planner, policy, caps, preemption and chunked prefill) over a simulated worker whose steps take
an accelerator profile's time, driven by its own event loop so that a run gives the same result
on any host.

Beyond StepPool (which has High cut-ins, as the batcher sends them) it has:
- its own event loop (run), one pool alone;
- steps waited: for each request, the steps that began after it arrived and before the step that
  gave its first token (0: the next step, or a cut-in into the one in flight);
- each class's KV peak (blocks held, after every plan and cut-in);
- `on_step(plans, now)`: every step's plans, for measurements of service (tenant_service.py).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from bench.sim.accelerators import Accelerator
from bench.sim.step_pool import StepPool
from bench.sim.workload import SimRequest
from services.common.priority import ORDER
from services.scheduler.policy import QoSSettings


class VirtualPool(StepPool):
    def __init__(self, accelerator: Accelerator, policy: str = "qos", settings: QoSSettings | None = None,
                 on_step: Callable[[dict, float], None] | None = None):
        super().__init__("virtual", accelerator, settings, policy)
        self.on_step = on_step
        self.steps_before: dict[int, int] = {}     # seq id -> steps begun before it arrived
        self.steps_waited: dict[int, int] = {}     # seq id -> steps waited for its first token
        self.kv_peak_blocks: Counter = Counter()   # priority -> most blocks held at once

    # --- the event loop -----------------------------------------------------------------------------

    def run(self, requests: Iterable[SimRequest]) -> float:
        """Every request arrives at its time; runs until nothing is left to do. Returns the
        virtual time at the end."""
        arrivals = sorted(requests, key=lambda r: r.arrival)
        i, now = 0, 0.0
        while True:
            next_arrival = arrivals[i].arrival if i < len(arrivals) else None
            next_event = self.next_event()
            if next_arrival is None and next_event is None:
                return now
            now = min(t for t in (next_arrival, next_event) if t is not None)
            if next_event is not None and next_event <= now:
                self.step_end(now)
            else:
                self.submit(arrivals[i], now)
                i += 1

    # --- StepPool's events, with the additions -------------------------------------------------------

    def submit(self, request: SimRequest, now: float) -> float | None:
        self.steps_before[request.request_id + 1] = self.steps
        return super().submit(request, now)         # blocks move only in a plan or a cut-in: noted there

    def _plan(self, now: float) -> float | None:
        end = super()._plan(now)
        self._note_kv()
        if end is not None and self.on_step is not None:
            self.on_step(self.plans, now)
        return end

    def first_token(self, request: SimRequest, now: float) -> None:
        super().first_token(request, now)
        seq_id = request.request_id + 1
        # self.steps counts the step that just ended (or the one a cut-in ran inside).
        self.steps_waited[seq_id] = max(0, self.steps - self.steps_before[seq_id] - 1)

    def cut_in_started(self, builder, now: float) -> None:
        self._note_kv()
        if self.on_step is not None:
            self.on_step({0: builder}, now)

    # --- measurements ----------------------------------------------------------------------------

    def _note_kv(self) -> None:
        held = self.worker.pool.holdings()
        for p in ORDER:
            self.kv_peak_blocks[p] = max(self.kv_peak_blocks[p], held.get(p, 0))
