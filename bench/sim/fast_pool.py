"""A pool of the cluster simulator as a queueing model of the real scheduler: fast enough for a
thousand pools at thousands of requests a second.

It follows services/scheduler/planner.py step by step, but in aggregate: decodes are counted per
class, not visited one by one, and a run of steps in which nothing but decoding can happen (no
prompt to prefill, nothing that may be admitted) is one event up to the next sequence that
finishes; an arrival in between cuts the run at the step in flight. Prefill tokens are handed
out by the real QoSPolicy (services/scheduler/policy.py: WFQ virtual times, High's first tokens
ahead, its debt limit), so the shares are the policy's own. Admission as the
planner does it: max_running sequences, each class within its KV cap (tokens, not blocks); a High
request that does not fit preempts the newest sequence of the lowest class (recompute), as does a
pool whose KV cache fills up while decoding.

What it leaves out: block rounding (a sequence holds its tokens, not whole blocks), tenants, LoRA,
chunk-level interleaving inside one step. bench/simulate.py --validate compares it with
bench/sim/step_pool.py, which drives the real planner, on a small cluster.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from bench.sim.accelerators import Accelerator
from bench.sim.pool_base import PoolBase
from bench.sim.workload import SimRequest
from services.common.priority import HIGH, ORDER
from services.scheduler.policy import QoSPolicy, QoSSettings

PREFILL, DECODE, GONE = 0, 1, 2


@dataclass(slots=True, eq=False)
class Seq:
    request: SimRequest
    priority: int
    tokens: int                  # prompt (after a preemption: prompt + output so far) to prefill
    outputs_left: int            # tokens still to generate
    remaining: int               # prompt tokens not yet computed
    kv: int = 0                  # tokens in its KV cache
    last_step: int = -1          # decoding: the step whose end gives its last token
    decode_from: int = 0         # decoding: the first step it decodes in
    state: int = PREFILL
    order: int = 0               # admission order (newest is preempted first)


class FastPool(PoolBase):
    def __init__(self, name: str, accelerator: Accelerator, settings: QoSSettings | None = None):
        super().__init__(name, accelerator)
        self.policy = QoSPolicy(settings or QoSSettings(tenant_fairness=False))
        self.caps = {p: self.policy.kv_cap(p) * accelerator.kv_tokens for p in ORDER}
        self.queue = {p: deque() for p in ORDER}
        self.prefilling = {p: deque() for p in ORDER}
        self.decoding: list = []                       # heap of (last_step, order, Seq)
        self.n_dec = dict.fromkeys(ORDER, 0)
        self.kv = dict.fromkeys(ORDER, 0)
        self.step = 0                                  # index of the next step to run
        self.admitted = 0
        # The step(s) in flight: start time, steps, duration of each, prefill chunks (Seq, tokens).
        self.run_start = 0.0
        self.run_steps = 0
        self.run_step_s = 0.0
        self.run_chunks: list = []
        self.run_kv = 0.0

    # --- the pool's state, as reports read it ------------------------------------------------------

    def running(self, p: int) -> int:
        return len(self.prefilling[p]) + self.n_dec[p]

    def kv_used(self) -> int:
        return sum(self.kv.values())

    # --- arrivals ----------------------------------------------------------------------------------

    def submit(self, request: SimRequest, now: float) -> float | None:
        p = request.priority
        self.queue[p].append(Seq(request, p, request.prompt_tokens, request.output_tokens, request.prompt_tokens))
        self.waiting_tokens[p] += request.prompt_tokens
        if self.busy_until is None:
            return self._plan(now)
        if self.run_steps > 1:
            # A run of decode-only steps: cut it at the step in flight, so the next plan sees this.
            done = min(int((now - self.run_start) / self.run_step_s), self.run_steps - 1)
            unrun = self.run_steps - done - 1           # planned, counted, and now not run
            self.busy_s -= unrun * self.run_step_s
            self.step_seconds -= unrun * self.run_step_s
            self.step_tokens -= unrun * sum(self.n_dec.values())
            self.step_kv_tokens -= unrun * self.run_kv
            self.steps -= unrun
            self._apply_decodes(done)
            self.run_start += done * self.run_step_s
            self.run_steps = 1
            self.busy_until = self.run_start + self.run_step_s
            return self.busy_until
        return None

    # --- one step (or run of steps) ending ---------------------------------------------------------

    def step_end(self, now: float) -> float | None:
        self._apply_decodes(self.run_steps, now)
        for seq, tokens in self.run_chunks:
            if seq.state != PREFILL:             # preempted while its step ran: nothing to add
                continue
            seq.remaining -= tokens
            seq.kv += tokens
            self.kv[seq.priority] += tokens
            if seq.remaining == 0:
                self.prefilling[seq.priority].remove(seq)
                self._first_token(seq, now)
        self.run_chunks = []
        self.busy_until = None
        return self._plan(now)

    def _apply_decodes(self, steps: int, now: float | None = None) -> None:
        """`steps` decode steps done: every decoding sequence has that many tokens more; those
        whose last token came finish (at `now`, the end of the run)."""
        if steps <= 0:
            return
        for p in ORDER:
            if self.n_dec[p]:
                self.kv[p] += self.n_dec[p] * steps
                self.policy.charge(p, self.n_dec[p] * steps)
                self.served[p] += self.n_dec[p] * steps
        self.step += steps
        decoding = self.decoding
        while decoding and decoding[0][0] < self.step:
            _, _, seq = heapq.heappop(decoding)
            if seq.state != DECODE:
                continue
            self._release(seq)
            self.n_dec[seq.priority] -= 1
            self.finish(seq.request, now if now is not None else self.run_start + steps * self.run_step_s)

    def _first_token(self, seq: Seq, now: float) -> None:
        if seq.request.first_token_at is None:
            self.first_token(seq.request, now)
        seq.outputs_left -= 1
        if seq.outputs_left <= 0:
            self._release(seq)
            self.finish(seq.request, now)
            return
        seq.state = DECODE
        seq.decode_from = self.step
        seq.last_step = self.step + seq.outputs_left - 1
        self.n_dec[seq.priority] += 1
        heapq.heappush(self.decoding, (seq.last_step, seq.order, seq))

    def _release(self, seq: Seq) -> None:
        """The sequence leaves the pool (finished or preempted): its KV tokens are freed."""
        held = self._kv_of(seq)
        self.kv[seq.priority] -= held
        seq.state = GONE

    def _kv_of(self, seq: Seq) -> int:
        if seq.state == DECODE:
            # Its prompt, plus one token per decode step it took part in.
            return seq.tokens + min(self.step, seq.last_step + 1) - seq.decode_from
        return seq.kv

    # --- planning ------------------------------------------------------------------------------

    def _plan(self, now: float) -> float | None:
        policy, acc = self.policy, self.accelerator
        n_dec = sum(self.n_dec.values())
        self._make_room_for_decodes(n_dec)
        n_dec = sum(self.n_dec.values())
        backlogged = {p for p in ORDER if self.queue[p] or self.running(p)}
        policy.backlog_changed(backlogged, now)
        budget = acc.max_step_tokens - n_dec
        chunks: list = []
        demand = {p for p in ORDER if self.prefilling[p] or self.queue[p]}
        first = policy.first_token_lane()
        if first is not None and first in demand:
            taken, budget = self._serve(first, float("inf"), budget, chunks)
            demand.discard(first)
        while budget > 0 and demand:
            lane, allowance = policy.pick_lane(demand)
            taken, budget = self._serve(lane, allowance, budget, chunks)
            if taken == 0 or not (self.prefilling[lane] or self.queue[lane]):
                demand.discard(lane)
        tokens = n_dec + sum(t for _, t in chunks)
        if tokens == 0:
            return None
        kv_read = self.kv_used()
        if chunks:
            steps, step_s = 1, self.step_s(tokens, kv_read, now)
        else:
            # Nothing but decoding until the next sequence finishes (an arrival may cut this).
            steps = self.decoding[0][0] - self.step + 1
            step_s = self.step_s(tokens, kv_read + n_dec * (steps - 1) / 2, now)
        self.run_start, self.run_steps, self.run_step_s, self.run_chunks = now, steps, step_s, chunks
        # The report counters take the whole run now (a cut takes back what did not run).
        self.steps += steps
        self.step_tokens += tokens + n_dec * (steps - 1)
        self.run_kv = kv_read + n_dec * (steps - 1) / 2      # KV read by each step, on average
        self.step_kv_tokens += self.run_kv * steps
        self.busy_s += steps * step_s
        self.step_seconds += steps * step_s
        self.busy_until = now + steps * step_s
        return self.busy_until

    def _serve(self, lane: int, allowance: float, budget: int, chunks: list) -> tuple[int, int]:
        """The lane's turn: prefill chunks of its admitted prompts, then admissions, until it used
        its allowance (at least one chunk) or the budget. Returns (tokens taken, budget left)."""
        taken = 0
        prefilling, queue = self.prefilling[lane], self.queue[lane]
        busy = {id(seq) for seq, _ in chunks}
        while budget > 0 and (taken == 0 or taken < allowance):
            seq = next((s for s in prefilling if id(s) not in busy), None)
            if seq is None:
                if not queue or not self._admit(lane):
                    break
                seq = prefilling[-1]
            chunk = min(seq.remaining, budget)
            chunks.append((seq, chunk))
            busy.add(id(seq))
            taken += chunk
            budget -= chunk
        if taken:
            self.policy.charge(lane, taken)
            self.served[lane] += taken
        return taken, budget

    def _admit(self, lane: int) -> bool:
        """The lane's next queued request starts (its prompt fits its class's cap and the pool);
        High preempts lower classes to make room."""
        seq = self.queue[lane][0]
        while not self._fits(seq):
            if lane != HIGH or not self._preempt(below=lane):
                return False
        self.queue[lane].popleft()
        self.waiting_tokens[lane] -= seq.tokens
        self.admitted += 1
        seq.order = self.admitted
        seq.state, seq.remaining, seq.kv = PREFILL, seq.tokens, 0
        self.prefilling[lane].append(seq)
        return True

    def _fits(self, seq: Seq) -> bool:
        running = sum(self.running(p) for p in ORDER)
        acc = self.accelerator
        return (running < acc.max_running and self.kv[seq.priority] + seq.tokens <= self.caps[seq.priority]
                and self.kv_used() + seq.tokens <= acc.kv_tokens)

    def _make_room_for_decodes(self, n_dec: int) -> None:
        """Decodes grow the cache by a token each: when that would take a class past its cap, its
        newest sequence goes back to its queue (recomputed later); when it would overflow the
        cache, the newest of the lowest class does, as the planner preempts."""
        for p in ORDER:
            while self.n_dec[p] and self.kv[p] + self.n_dec[p] > self.caps[p] and self._preempt(only=p):
                pass
        while self.kv_used() + sum(self.n_dec.values()) > self.accelerator.kv_tokens and self._preempt(below=0):
            pass

    def _preempt(self, below: int = 0, only: int = 0) -> bool:
        """Preempt the newest running sequence of the lowest class lower than `below` (any class
        when 0; only class `only` when given); False when there is none."""
        for p in reversed(ORDER):
            if below and p <= below:
                return False
            if only and p != only:
                continue
            candidates = [s for s in self.prefilling[p]] + [s for _, _, s in self.decoding
                                                             if s.state == DECODE and s.priority == p]
            if not candidates:
                continue
            victim = max(candidates, key=lambda s: s.order)
            was_decoding = victim.state == DECODE
            done = victim.request.output_tokens - victim.outputs_left
            self.recomputed[p] += self._kv_of(victim)
            self._release(victim)
            if was_decoding:
                self.n_dec[p] -= 1
            else:
                self.prefilling[p].remove(victim)
            again = Seq(victim.request, p, victim.request.prompt_tokens + done, victim.outputs_left,
                        victim.request.prompt_tokens + done)
            self.queue[p].appendleft(again)
            self.waiting_tokens[p] += again.tokens
            self.preemptions += 1
            return True
        return False

    def waiting(self, p: int) -> int:
        return len(self.queue[p])

    def prefill_left(self, p: int) -> int:
        return self.waiting_tokens[p] + sum(s.remaining for s in self.prefilling[p])

    def weights(self) -> tuple:
        w = self.policy.weights()
        return tuple(w[p] for p in ORDER)

    def kv_by_class(self) -> tuple:
        return tuple(self.kv[p] for p in ORDER)

    def kv_caps(self) -> tuple:
        return tuple(self.policy.kv_cap(p) for p in ORDER)
