"""How long a new request would wait for its first token on a pool, predicted from the pool's
last stats (no I/O): the model behind `router.routing = "slo-cost"` (services/router/routing.py).

Each pool reports, cumulatively, its steps' wall time, worker-steps and tokens computed. Between
two reports that gives one sample of (tokens per worker-step, ms per step); a least-squares line
through recent samples (older ones fade) is the pool's step time:

    step_ms(tokens) = fixed_ms + ms_per_token * tokens

A new request of class c with a P-token prompt then waits for the tokens queued ahead of it in its
class, and its own prompt, to be computed at the share of each step that weighted fair queueing
gives its class (5:3:2 among the classes with work; High's first tokens go ahead of the others):

    ttft = base_ms[c] + P * ms_per_prompt_token[c]

Both terms are computed once per report, so that a prediction is two multiplications. The
router compares what happened with what it predicted (`observe`) and keeps, per pool, a margin:
the 90th percentile of actual / predicted over recent requests. A pool meets an SLO when
prediction x margin <= SLO.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.common.priority import HIGH, ORDER

FADE = 0.9                  # weight left to older step samples at each new one
MIN_SAMPLE_STEPS = 1        # a report with fewer new worker-steps carries no step-time sample
MARGIN_SAMPLES = 200        # actual/predicted ratios kept per pool
MARGIN_QUANTILE = 0.9
MARGIN_BOUNDS = (0.25, 8.0)   # below 1: the model overestimates that pool
MARGIN_START = 1.5          # before any request was observed
MIN_PREFILL_SHARE = 0.05    # a class always gets this share of a step's budget (no division by 0)


@dataclass(slots=True)
class PoolReport:
    """What the latency model reads from a pool's stats (scheduler_pb2.PoolStats, or a simulated
    pool's state in bench/sim/): counters since start and the queue now, per class H, M, L."""
    step_seconds: float = 0.0
    worker_steps: int = 0
    step_tokens: int = 0
    steps: int = 0
    waiting: tuple = (0, 0, 0)           # requests queued
    waiting_tokens: tuple = (0, 0, 0)    # tokens they still need computed
    running: tuple = (0, 0, 0)
    weights: tuple = (5.0, 3.0, 2.0)
    workers: int = 1
    max_step_tokens: int = 512           # per worker
    max_running: int = 64                # per worker


@dataclass(slots=True)
class StepFit:
    """step_ms = fixed_ms + ms_per_token * tokens, by least squares over faded samples."""
    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    fixed_ms: float = 0.0
    ms_per_token: float = 0.0

    @property
    def known(self) -> bool:
        return self.sw > 0

    def add(self, tokens: float, ms: float, weight: float) -> None:
        self.sw, self.sx, self.sy = FADE * self.sw + weight, FADE * self.sx + weight * tokens, FADE * self.sy + weight * ms
        self.sxx = FADE * self.sxx + weight * tokens * tokens
        self.sxy = FADE * self.sxy + weight * tokens * ms
        mean_x, mean_y = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mean_x * mean_x
        cov = self.sxy / self.sw - mean_x * mean_y
        if var > 1e-6 * max(mean_x * mean_x, 1.0) and cov > 0:
            slope = cov / var
            self.ms_per_token, self.fixed_ms = slope, max(mean_y - slope * mean_x, 0.0)
        else:
            # All samples at one batch size: fixed and per-token parts cannot be told apart. Take
            # a third as fixed (what the engine's profile shows at small batches); more samples
            # at other sizes correct it.
            self.fixed_ms = mean_y / 3
            self.ms_per_token = (mean_y - self.fixed_ms) / max(mean_x, 1.0)

    def step_ms(self, tokens: float) -> float:
        return self.fixed_ms + self.ms_per_token * tokens


@dataclass(slots=True)
class LatencyModel:
    """One pool's predicted time to first token per class, refreshed on every report."""
    fit: StepFit = field(default_factory=StepFit)
    last: PoolReport | None = None
    base_ms: list = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])          # by priority 1..3
    per_prompt_token_ms: list = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    tpot_ms: float = 0.0                 # time per output token at the current batch
    ratios: deque = field(default_factory=lambda: deque(maxlen=MARGIN_SAMPLES))
    margin: float = MARGIN_START
    known: bool = False                  # a step-time sample was seen (a field: read per decision)
    _since_margin: int = 0

    def report(self, report: PoolReport) -> None:
        last, self.last = self.last, report
        if last is not None:
            steps = report.steps - last.steps
            worker_steps = report.worker_steps - last.worker_steps
            if steps >= MIN_SAMPLE_STEPS and worker_steps > 0:
                tokens = (report.step_tokens - last.step_tokens) / worker_steps
                ms = (report.step_seconds - last.step_seconds) * 1000 / steps
                self.fit.add(tokens, ms, steps)
        if self.fit.known:
            self.known = True
            self._refresh(report)

    def _refresh(self, r: PoolReport) -> None:
        """The per-class terms of the prediction, from the queue and the step time now."""
        fit, budget = self.fit, r.max_step_tokens
        workers = max(r.workers, 1)
        running = sum(r.running)
        decodes = running / workers                       # one token each per step, per worker
        full_step = fit.step_ms(budget)
        self.tpot_ms = fit.step_ms(max(decodes, 1.0) if not any(r.waiting) else budget)
        if not any(r.waiting) and running < workers * r.max_running:
            # Room now: admitted at the next step, its prompt gets what the decodes leave of each
            # step on one worker; it waits half a step for the one in flight, if any.
            per_token = full_step / max(budget - decodes, budget * MIN_PREFILL_SHARE)
            base = (fit.step_ms(decodes) / 2 if running else 0.0) + fit.step_ms(decodes)
            for p in ORDER:
                self.base_ms[p], self.per_prompt_token_ms[p] = base, per_token
            return
        # Backlogged: each class's prompts get its fair share of the pool's steps (less its own
        # decodes); High's first tokens go ahead of everyone's prefill.
        weights = dict(zip(ORDER, r.weights))
        busy = {p for p, w, n in zip(ORDER, r.waiting, r.running) if w or n}
        capacity = budget * workers
        for i, p in enumerate(ORDER):
            if p == HIGH:
                share_tokens = capacity - (running - r.running[0])
                ahead = r.waiting_tokens[0]
            else:
                classes = busy | {p}
                share = weights[p] / sum(weights[c] for c in classes)
                share_tokens = share * capacity - r.running[i]
                ahead = r.waiting_tokens[i]
            share_tokens = max(share_tokens, capacity * MIN_PREFILL_SHARE)
            per_token = full_step / share_tokens
            self.base_ms[p] = full_step / 2 + ahead * per_token
            self.per_prompt_token_ms[p] = per_token

    def ttft_ms(self, priority: int, prompt_tokens: int) -> float:
        return self.base_ms[priority] + prompt_tokens * self.per_prompt_token_ms[priority]

    def e2e_ms(self, priority: int, prompt_tokens: int, max_tokens: int) -> float:
        return self.ttft_ms(priority, prompt_tokens) + max(max_tokens - 1, 0) * self.tpot_ms

    def dispatched(self, priority: int, prompt_tokens: int) -> None:
        """A request was just sent here: the next one of its class waits for it too, until the
        pool's next report says how far it got."""
        self.base_ms[priority] += prompt_tokens * self.per_prompt_token_ms[priority]

    def observe(self, predicted_ms: float, actual_ms: float) -> None:
        """A request this pool served: how far off the prediction was feeds the margin."""
        if predicted_ms <= 0:
            return
        self.ratios.append(actual_ms / predicted_ms)
        self._since_margin += 1
        if self._since_margin >= 10 or len(self.ratios) < 10:
            self._since_margin = 0
            ordered = sorted(self.ratios)
            ratio = ordered[min(int(MARGIN_QUANTILE * len(ordered)), len(ordered) - 1)]
            self.margin = min(max(ratio, MARGIN_BOUNDS[0]), MARGIN_BOUNDS[1])
