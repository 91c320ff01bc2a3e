"""Short steps while High traffic is present (`[pools.scheduler] high_step_ms`, issue 20).

A High request that arrives mid-step first waits for the step in flight, then for its own. Under
a burst a step carries a full prefill chunk and every running sequence's decode (on this project's
CPU machine ~90 ms against ~25 ms for an idle High request), so the step in flight alone puts
High's tail at several times its idle latency. While High requests are in the pool (queued,
running, or one arrived in the last HIGH_RECENT_S), each step is planned to take at most
`high_step_ms` by the pool's own measured step time; the other classes' work beyond it waits for
the next step, and the decodes left out go first then (in turn, so every sequence keeps
decoding). High's own work is never cut. The other classes lose what the extra steps cost (each
step's fixed part), which is what the setting trades.

Step time is fitted from executed steps (services/common/step_fit.py) on the tokens a worker
computed and the context tokens its sequences attended to:

    step_ms = fixed_ms + ms_per_token * tokens + ms_per_context_token * sum(context + tokens)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from services.common.step_fit import StepFit

log = logging.getLogger(__name__)

HIGH_RECENT_S = 1.0       # a High request arrived this recently: more are likely, keep steps short
FIT_FADE = 0.98           # per step: the fit follows the last ~50 steps
MIN_FIT_STEPS = 8         # steps measured before the fit is trusted to cut a plan
REPORT_EVERY = 500        # steps between two log lines on the fit and the steps cut


@dataclass(slots=True)
class StepCost:
    """What one worker's step may still spend and what each token costs (the planner's view)."""
    ms_left: float
    ms_per_token: float
    ms_per_context_token: float

    def charge(self, tokens: int, context: int) -> None:
        """`tokens` more scheduled for a sequence that will have `context` tokens after them."""
        self.ms_left -= self.ms_per_token * tokens + self.ms_per_context_token * context

    def decodes_within(self, computed: list[int]) -> int:
        """How many of these decodes (each sequence's tokens computed so far) fit the time left,
        charging them."""
        left, per_token, per_context = self.ms_left, self.ms_per_token, self.ms_per_context_token
        count = 0
        for done in computed:
            cost = per_token + per_context * (done + 1)
            if cost > left:
                break
            left -= cost
            count += 1
        self.ms_left = left
        return count

    def tokens_within(self, computed: int, wanted: int) -> int:
        """How many of `wanted` prefill tokens, after `computed`, fit the time left (not charged)."""
        per_token = self.ms_per_token + self.ms_per_context_token
        room = self.ms_left - self.ms_per_context_token * computed
        return max(0, min(wanted, int(room / per_token))) if per_token > 0 else wanted


class StepClock:
    """The pool's step time, learnt from its steps, and each step's time budget."""

    def __init__(self, high_step_ms: float):
        self.high_step_ms = high_step_ms
        self.fit = StepFit(fade=FIT_FADE)
        self.measured = 0
        self.budgeted = 0                 # steps planned within a budget, since the last report
        self.cut = 0                      # ... of which some work was left out for time
        self.budgeted_ms: list[float] = []   # ... and what they took
        self._next_budgeted = False       # the step being executed was planned within a budget
        self.last_high_at = float("-inf")

    def high_arrived(self, now: float) -> None:
        self.last_high_at = now

    def observe(self, tokens: float, context: float, ms: float) -> None:
        """One executed step: per worker, tokens computed and context attended; its wall time."""
        self.fit.add(tokens, context, ms, 1.0)
        self.measured += 1
        if self._next_budgeted:
            self.budgeted_ms.append(ms)
            self._next_budgeted = False
        if self.measured % REPORT_EVERY == 0:
            fit = self.fit
            fit.solve()
            took = sorted(self.budgeted_ms)
            taken = (f"; they took {took[len(took) // 2]:.0f} ms (median), {took[int(0.99 * (len(took) - 1))]:.0f} "
                     f"ms (P99)") if took else ""
            log.info("step time %.1f ms + %.3f ms/token + %.5f ms/context token; last %d steps: %d within "
                     "%.0f ms (High around), %d of them cut%s", fit.fixed_ms, fit.ms_per_token, fit.ms_per_kv_token,
                     REPORT_EVERY, self.budgeted, self.high_step_ms, self.cut, taken)
            self.budgeted = self.cut = 0
            self.budgeted_ms = []

    def planned(self, cut: bool) -> None:
        """A step was planned within a budget (`cut`: work was left out for time)."""
        self.budgeted += 1
        self.cut += cut
        self._next_budgeted = True

    def budget(self, high_present: bool, now: float) -> StepCost | None:
        """The time budget of a step planned now, or None when steps are not cut (no High around,
        or the step time not measured yet)."""
        if not (high_present or now - self.last_high_at < HIGH_RECENT_S) or self.measured < MIN_FIT_STEPS:
            return None
        fit = self.fit
        fit.solve()
        return StepCost(self.high_step_ms - fit.fixed_ms, fit.ms_per_token, fit.ms_per_kv_token)
