"""What a pool's steps have added up to since start, and the first-token estimate made from them.

The totals are cumulative so that a reader can difference two reports: the router's latency
model reads them from PoolStats (services/router/latency_model.py) and fits the pool's step time
from what the steps computed and how long they took. The smoothed token rate is the scheduler's
own, for the wait it quotes a request with an SLO at admission (admission.check_slo).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.policy import SchedulingPolicy

RATE_SMOOTHING = 0.2        # weight of the newest step in the smoothed token rate


@dataclass
class StepTotals:
    step_seconds: float = 0.0       # steps' wall time, each from its plans sent to its last answer
    worker_steps: int = 0           # plans that computed tokens (a step over three workers: three)
    step_tokens: int = 0            # tokens those plans computed
    step_kv_tokens: int = 0         # KV tokens their workers held, summed over the worker-steps
    tokens_per_second: float = 0.0  # served tokens, smoothed over recent steps

    def record(self, elapsed_s: float, tokens: int, worker_steps: int, kv_tokens: int) -> None:
        """A step that computed `tokens` (> 0) on `worker_steps` workers holding `kv_tokens`."""
        self.step_seconds += elapsed_s
        self.worker_steps += worker_steps
        self.step_tokens += tokens
        self.step_kv_tokens += kv_tokens
        rate = tokens / max(elapsed_s, 1e-6)
        self.tokens_per_second = rate if not self.tokens_per_second \
            else (1 - RATE_SMOOTHING) * self.tokens_per_second + RATE_SMOOTHING * rate


def estimated_wait_ms(policy: SchedulingPolicy, lanes_running: Iterable[int], tokens_per_second: float,
                      priority: int, prompt_tokens: int, tenant: str = "", weight: float = 1.0) -> float:
    """Rough time to a new request's first token: the tokens queued ahead of it in its lane (with
    tenant fairness, as its tenant's share sees them: TenantQueue.tokens_ahead) plus its own
    prompt, at the lane's fair share of the recent token rate. 0 when no rate has been measured yet."""
    if not tokens_per_second:
        return 0.0
    lane = policy.lane_of_priority(priority)
    ahead = policy.queue(lane).tokens_ahead(tenant, weight, prompt_tokens)
    backlogged = {l for l in policy.lanes if policy.queue(l)} | set(lanes_running) | {lane}
    return (ahead + prompt_tokens) / (tokens_per_second * policy.share(lane, backlogged)) * 1000
