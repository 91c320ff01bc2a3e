"""How long a new request would wait for its first token on a pool, predicted from the pool's
last stats (no I/O): the model behind `router.routing = "slo-cost"` (services/router/routing.py).

Each pool reports, cumulatively, its steps' wall time, worker-steps, tokens computed and KV tokens
held. Between two reports that gives one sample of (tokens and KV tokens per worker-step, ms per
step); a least-squares fit through recent samples (older ones fade) is the pool's step time:

    step_ms(tokens, kv) = fixed_ms + ms_per_token * tokens + ms_per_kv_token * kv

A new request of class c with a P-token prompt waits until the prefill tokens that go before
its own are computed, at what the decodes leave of each step (F tokens a step on W workers):
High's queued prompts first (High's first tokens go ahead of the others), then its own class's
queue and prompt (x = queued + P), shared with the other backlogged class by weighted fair
queueing: that one takes w_o / w_c tokens for each of ours until its queue (y) runs dry:

    tokens = high_queue + x + min(y, x * w_o / w_c)
    ttft   = half a step in flight + max(one step of R decodes + tokens, tokens * step_ms(B) / (W F))
             + the longer of: (requests ahead + 1 - free running slots) / completions per second,
               (x - the class's KV room) / KV tokens its completions free per second, if > 0

(one step when the tokens fit in one, else as many full steps as they need).
Everything but P is computed once per report, so that a prediction is a few multiplications. The
router compares what happened with what it predicted (`observe`) and keeps, per pool, a margin:
the 99th percentile of actual / predicted over recent requests. A pool meets an SLO when
prediction x margin <= SLO.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.common.priority import HIGH, LOW, MEDIUM, ORDER
from services.common.step_fit import FADE, StepFit

MIN_SAMPLE_STEPS = 1        # a report with fewer new worker-steps carries no step-time sample
MARGIN_SAMPLES = 200        # actual/predicted ratios kept per pool
MARGIN_QUANTILE = 0.99
MARGIN_TRUSTED = 30         # until this many requests were observed, the margin is at least MARGIN_START
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
    step_kv_tokens: int = 0              # KV tokens held at each worker-step, summed
    finished: int = 0                    # requests completed
    at_s: float = 0.0                    # when the report was taken (any monotonic clock)
    steps: int = 0
    kv_tokens: int = 0                   # held now, all workers
    kv_capacity: int = 0                 # KV tokens all workers can hold (0: unknown)
    kv_by_class: tuple = (0, 0, 0)       # KV tokens each class holds now
    kv_caps: tuple = (1.0, 1.0, 1.0)     # largest share of the KV cache each class may hold
    waiting: tuple = (0, 0, 0)           # requests queued
    waiting_tokens: tuple = (0, 0, 0)    # prompt tokens still to compute (queued + running ones' rest)
    running: tuple = (0, 0, 0)
    weights: tuple = (5.0, 3.0, 2.0)
    workers: int = 1
    max_step_tokens: int = 512           # per worker
    max_running: int = 64                # per worker


@dataclass(slots=True)
class LatencyModel:
    """One pool's predicted time to first token per class, refreshed on every report."""
    fit: StepFit = field(default_factory=StepFit)
    last: PoolReport | None = None
    # By priority (index 1..3): tokens queued in the class, tokens that go first (High's queue),
    # the other backlogged class's queue and its tokens per one of ours (weights).
    queued: list = field(default_factory=lambda: [0.0] * 4)
    first: list = field(default_factory=lambda: [0.0] * 4)
    other_queue: list = field(default_factory=lambda: [0.0] * 4)
    other_ratio: list = field(default_factory=lambda: [0.0] * 4)
    slots_ahead: list = field(default_factory=lambda: [0.0] * 4)   # requests that take a slot before ours
    free_slots: float = 0.0              # running slots free now (max_running x workers - running)
    ms_per_slot: float = 0.0             # time until a running request completes and frees one
    kv_room: list = field(default_factory=lambda: [0.0] * 4)        # KV tokens the class may still take
    ms_per_kv_token: list = field(default_factory=lambda: [0.0] * 4)  # time until the class frees one
    finish_rate: float = 0.0             # requests completed per second, smoothed
    terms: list = field(default_factory=lambda: [None] * 4)   # _pack(): per class, for ttft_ms
    step_terms: tuple = (0.0, 0.0, 0.0, 0.0)
    in_flight_ms: float = 0.0            # half the step now running
    one_step_ms: float = 0.0             # a step of the running decodes alone
    ms_per_token: float = 0.0            # what each prefill token adds to a step
    ms_per_full_token: float = 0.0       # a full step's time per prefill token it carries
    tpot_ms: float = 0.0                 # time per output token at the current batch
    ratios: deque = field(default_factory=lambda: deque(maxlen=MARGIN_SAMPLES))
    margin: float = MARGIN_START
    known: bool = False                  # a step-time sample was seen (a field: read per decision)
    stale: bool = False                  # a report came since the terms were computed
    # Eager (the router: terms computed as each report arrives, off the request path) or lazy
    # (the simulator: a thousand pools report far more often than each is asked about).
    lazy: bool = False
    _since_margin: int = 0

    def report(self, report: PoolReport) -> None:
        last, self.last = self.last, report
        if last is not None and report.at_s > last.at_s:
            rate = (report.finished - last.finished) / (report.at_s - last.at_s)
            self.finish_rate = rate if not self.finish_rate else FADE * self.finish_rate + (1 - FADE) * rate
        if last is not None:
            steps = report.steps - last.steps
            worker_steps = report.worker_steps - last.worker_steps
            if steps >= MIN_SAMPLE_STEPS and worker_steps > 0:
                tokens = (report.step_tokens - last.step_tokens) / worker_steps
                kv_tokens = (report.step_kv_tokens - last.step_kv_tokens) / worker_steps
                ms = (report.step_seconds - last.step_seconds) * 1000 / steps
                self.fit.add(tokens, kv_tokens, ms, steps)
        if self.fit.known:
            self.known = self.stale = True
            if not self.lazy:
                self._refresh()

    def _refresh(self) -> None:
        """The per-class terms of the prediction, from the last report's queue and step time."""
        self.stale = False
        r, fit = self.last, self.fit
        fit.solve()
        budget = r.max_step_tokens
        workers = max(r.workers, 1)
        running = sum(r.running)
        decodes = running / workers                       # one token each per step, per worker
        kv = r.kv_tokens / workers
        prefill = max(budget - decodes, budget * MIN_PREFILL_SHARE)
        self.one_step_ms = fit.step_ms(decodes, kv)
        self.in_flight_ms = self.one_step_ms / 2 if running else 0.0
        self.ms_per_token = fit.ms_per_token
        self.ms_per_full_token = fit.step_ms(budget, kv) / (prefill * workers)
        self.tpot_ms = fit.step_ms(budget if any(r.waiting) else max(decodes, 1.0), kv)
        # More requests ahead of it than free running slots (max_running): a new request also waits
        # for completions to free the rest, at the pool's recent completion rate.
        self.free_slots = workers * r.max_running - running
        self.ms_per_slot = 1000 / max(self.finish_rate, 1e-3)
        weights = dict(zip(ORDER, r.weights))
        queued = dict(zip(ORDER, r.waiting_tokens))
        waiting = dict(zip(ORDER, r.waiting))
        running_by = dict(zip(ORDER, r.running))
        kv_free = r.kv_capacity - r.kv_tokens
        for p, held, cap in zip(ORDER, r.kv_by_class, r.kv_caps):
            # A class at its KV cap (or a full cache) admits only as its own sequences complete and
            # free their tokens: at its share of the completions, each freeing its average.
            self.kv_room[p] = min(cap * r.kv_capacity - held, kv_free) if r.kv_capacity else float("inf")
            completions_per_ms = self.finish_rate / 1000 * running_by[p] / max(running, 1)
            per_seq = held / running_by[p] if running_by[p] else 0.0
            self.ms_per_kv_token[p] = 1 / (completions_per_ms * per_seq) if completions_per_ms and per_seq else 0.0
        for p in ORDER:
            self.queued[p] = queued[p]
            if p == HIGH:
                self.first[p] = self.other_queue[p] = self.other_ratio[p] = 0.0
                self.slots_ahead[p] = waiting[HIGH] + 1
                continue
            other = MEDIUM if p == LOW else LOW
            self.first[p] = queued[HIGH]
            self.other_queue[p] = queued[other]
            self.other_ratio[p] = weights[other] / weights[p]
            self.slots_ahead[p] = waiting[HIGH] + waiting[p] + min(waiting[other], waiting[p] * self.other_ratio[p]) + 1
        self.step_terms = (self.in_flight_ms, self.one_step_ms, self.ms_per_token, self.ms_per_full_token)
        for p in ORDER:
            self._pack(p)

    def _pack(self, p: int) -> None:
        """One tuple per class of what ttft_ms reads (one lookup, not a dozen: it runs per pool
        per routing decision)."""
        kv_room, ms_per_kv = self.kv_room[p], self.ms_per_kv_token[p]
        if kv_room == float("inf") or not ms_per_kv:       # no KV limit known: no KV wait (and no NaN)
            kv_room, ms_per_kv = 0.0, 0.0
        self.terms[p] = (self.queued[p], self.first[p], self.other_queue[p], self.other_ratio[p],
                         (self.slots_ahead[p] - self.free_slots) * self.ms_per_slot, kv_room, ms_per_kv)

    def ttft_ms(self, priority: int, prompt_tokens: int) -> float:
        if self.stale:
            self._refresh()
        queued, first, other_queue, other_ratio, slot_wait, kv_room, ms_per_kv = self.terms[priority]
        mine = queued + prompt_tokens
        other = mine * other_ratio
        tokens = first + mine + (other if other < other_queue else other_queue)
        in_flight, one_step_ms, ms_per_token, ms_per_full_token = self.step_terms
        one_step = one_step_ms + tokens * ms_per_token
        full_steps = tokens * ms_per_full_token
        wait = (mine - kv_room) * ms_per_kv
        if slot_wait > wait:
            wait = slot_wait
        return in_flight + (one_step if one_step > full_steps else full_steps) + (wait if wait > 0 else 0.0)

    def lower_bound(self, priority: int) -> tuple[float, float, float, float]:
        """(a, b, c, d) with ttft_ms(priority, P) >= max(a + b P, c + d P) for every P, as long
        as nothing but dispatches changes the model (they only make it slower)."""
        if self.stale:
            self._refresh()
        queued, first = self.terms[priority][0], self.terms[priority][1]
        in_flight, one_step_ms, ms_per_token, ms_per_full_token = self.step_terms
        ahead = queued + first
        return (in_flight + one_step_ms + ahead * ms_per_token, ms_per_token,
                in_flight + ahead * ms_per_full_token, ms_per_full_token)

    def e2e_ms(self, priority: int, prompt_tokens: int, max_tokens: int) -> float:
        return self.ttft_ms(priority, prompt_tokens) + max(max_tokens - 1, 0) * self.tpot_ms

    def dispatched(self, priority: int, prompt_tokens: int) -> None:
        """A request was just sent here: the next one of its class waits for it too, until the
        pool's next report says how far it got."""
        if self.stale:
            self._refresh()
        self.queued[priority] += prompt_tokens
        self.slots_ahead[priority] += 1
        self._pack(priority)

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
            if len(ordered) < MARGIN_TRUSTED:
                ratio = max(ratio, MARGIN_START)
            self.margin = min(max(ratio, MARGIN_BOUNDS[0]), MARGIN_BOUNDS[1])
