"""Arrivals for the cluster simulator: the Azure 2023 traces (bench/traces/) replayed at a chosen
rate, or Poisson arrivals whose prompt and output lengths are drawn from a trace. The class of a
request comes from the trace's own lengths, by the QoS benchmark's rule (bench/qos_workloads.py
trace_priority): short chat turns are High, prompts over 2,048 tokens are Low, the rest Medium.
"""
from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime

from bench.qos_workloads import TRACE_DIR, TRACES, trace_priority
from services.common.priority import HIGH, LOW, MEDIUM

CLASS_OF = {"high": HIGH, "medium": MEDIUM, "low": LOW}


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request as the simulator follows it; times in simulated seconds."""
    request_id: int
    arrival: float
    priority: int
    prompt_tokens: int
    output_tokens: int
    pool: str = ""                   # where the router sent it (set beforehand: sent there)
    tenant: str = ""
    scheduled_at: float | None = None        # the first step (or cut-in) computing it began
    first_token_at: float | None = None
    finished_at: float | None = None
    predicted_ttft_ms: float | None = None
    # A real run replayed (bench/sim/replay.py): the prompt length the real router saw (its estimate
    # from the text; 0: the true count) and the time the request spent outside the pools (client,
    # router, gRPC hops), which the router's TTFT includes and the simulated pools do not.
    routed_prompt_tokens: int = 0
    outside_ms: float = 0.0
    # ... and the prompt tokens its prefix cache served there: not computed, billed at a discount.
    cached_tokens: int = 0
    # ... or, where the run's prompts are known, their token ids: a pool with prefix caching then
    # finds what they share itself (and sets cached_tokens), holding the shared blocks as it would.
    prompt_ids: list[int] | None = None

    @property
    def pool_ttft_ms(self) -> float | None:
        """From arrival at the pool to the first token (what a scheduler measures)."""
        return None if self.first_token_at is None else (self.first_token_at - self.arrival) * 1000

    @property
    def pool_queue_ms(self) -> float | None:
        """From arrival at the pool until a step first computed it (the scheduler's queue_ms)."""
        return None if self.scheduled_at is None else (self.scheduled_at - self.arrival) * 1000

    @property
    def ttft_ms(self) -> float | None:
        """As the client sees it: the pool's and the time outside."""
        return None if self.first_token_at is None else (self.first_token_at - self.arrival) * 1000 + self.outside_ms


def trace_rows(trace: str) -> list[tuple[float, int, int]]:
    """(seconds since the first row, prompt tokens, output tokens) of a trace's rows."""
    with open(TRACE_DIR / TRACES[trace], newline="") as f:
        rows = list(csv.DictReader(f))

    def seconds(stamp: str) -> float:
        return datetime.strptime(stamp[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()

    start = seconds(rows[0]["TIMESTAMP"])
    return [(seconds(r["TIMESTAMP"]) - start, int(r["ContextTokens"]), max(1, int(r["GeneratedTokens"])))
            for r in rows]


def _request(i: int, at: float, prompt: int, output: int, max_prompt: int) -> SimRequest:
    return SimRequest(i, at, CLASS_OF[trace_priority(prompt, output)], max(1, min(prompt, max_prompt)), output)


def trace_replay(trace: str, rate: float, duration_s: float, max_prompt: int = 8192) -> list[SimRequest]:
    """The trace's rows in order, its clock sped up so that requests arrive at `rate` per second on
    average; the trace repeats (shifted in time) when `duration_s` outlasts it."""
    rows = trace_rows(trace)
    span = rows[-1][0] or 1.0
    speedup = rate * span / len(rows)
    out: list[SimRequest] = []
    offset = 0.0
    while True:
        for at, prompt, output in rows:
            t = offset + at / speedup
            if t >= duration_s:
                return out
            out.append(_request(len(out), t, prompt, output, max_prompt))
        offset += span / speedup


def poisson(trace: str, rate: float, duration_s: float, seed: int, max_prompt: int = 8192):
    """Poisson arrivals at `rate` per second, lengths drawn from the trace's rows (a generator:
    millions of requests need not be held at once)."""
    rows = trace_rows(trace)
    rng = random.Random(seed)
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return
        _, prompt, output = rows[rng.randrange(len(rows))]
        yield _request(i, t, prompt, output, max_prompt)
        i += 1
