"""What goes wrong in a run, and when, all drawn from the run's seed.

Each seed picks a mix: how often each fault happens (many seeds have a few kinds only, so that a
fault's effects are not always masked by another's), then every decision point of the step
protocol asks `Faults` whether something happens there:

    registration    Info fails or hangs past its 5 s timeout; the first (hello) answer never comes
    reconnect       the stream breaks right after the hello
    plan received   the stream breaks (or the process dies) before the step computes
    mid-step        it breaks, or the process dies, while the step computes
    between steps   it breaks right after the answer, before the next plan is sent
    answers         late (within the step timeout), duplicated, for a step never sent, stale
                    (an earlier step's id), cut-in answers after the host step's (out of order),
                    a token for a sequence not in the plan (quarantine)
    hangs           the process stops past the step timeout, then goes on (answers, late)
    processes       crash and restart under the same address (empty), or drain (no new
                    sequences, then the stream ends) and come back; a worker registers late; a
                    DNS member leaves and comes back
    clients         cancel before their first token, mid-stream, or after their last token
    pool            adapter loads, reloads and unloads; a scheduler drain

Faults stop at `quiet_at` (virtual seconds): after it the queues must drain.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

KINDS = ("break_before_step", "break_mid_step", "break_between_steps", "crash", "late", "duplicate",
         "wrong_step", "stale_step", "reorder", "hang", "broken_answer", "info_fail", "hello_lost",
         "break_after_hello", "drain_worker", "cancel", "adapters", "scheduler_drain", "late_register",
         "dns_leave")


@dataclass
class Faults:
    rng: random.Random
    quiet_at: float
    rates: dict[str, float] = field(default_factory=dict)   # kind -> chance at each decision point
    log: list[tuple[float, str, str]] = field(default_factory=list)   # (time, kind, where)
    enabled: bool = True

    @classmethod
    def draw(cls, rng: random.Random, quiet_at: float, only: tuple[str, ...] = ()) -> Faults:
        """A seed's mix: each kind on with probability 1/2 (or exactly `only`), at a rate of its own."""
        kinds = only or tuple(k for k in KINDS if rng.random() < 0.5)
        # At each decision point of a step (most kinds), or each chaos tick (PER_TICK kinds).
        scale = {"cancel": 0.3, "late": 0.1, "crash": 0.15, "adapters": 0.15, "scheduler_drain": 0.03,
                 "late_register": 0.2, "dns_leave": 0.1, "drain_worker": 0.05}
        rates = {k: rng.uniform(0.2, 1.0) * scale.get(k, 0.02) for k in kinds}
        return cls(rng, quiet_at, rates)

    def now(self, kind: str, at: float, where: str = "") -> bool:
        """Does a `kind` fault happen here, now? (Logged when it does.)"""
        rate = self.rates.get(kind)
        if not rate or not self.enabled or at >= self.quiet_at or self.rng.random() >= rate:
            return False
        self.log.append((round(at, 6), kind, where))
        return True

    def has(self, kind: str) -> bool:
        return kind in self.rates

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, kind, _ in self.log:
            out[kind] = out.get(kind, 0) + 1
        return out
