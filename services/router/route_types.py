"""What routing decides on and decides: pool specs and loads, the request as routing sees it, the
decision (services/router/routing.py decides; slo_cost.py is its slo-cost mode)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from services.common.priority import HIGH, LOW, MEDIUM
from services.router.latency_model import PoolReport

DEFAULT_COST = {"cuda": 1.0, "npu": 0.3, "cpu": 0.1}
DEFAULT_SLO_MS = {HIGH: 200.0, MEDIUM: 2_000.0, LOW: 30_000.0}


class NoPoolError(LookupError):
    """No pool can serve the request; the message names the model (and what was missing)."""


@dataclass(slots=True, frozen=True)
class PoolSpec:
    name: str
    device: str                          # cuda | npu | cpu
    models: frozenset[str]
    cost_per_token: float | None = None  # None: the device's default
    lora: bool = False
    primary: bool = False                # the pool High goes to when there is no GPU pool

    @property
    def cost(self) -> float:
        return DEFAULT_COST[self.device] if self.cost_per_token is None else self.cost_per_token


@dataclass(slots=True)
class PoolLoad:
    """What the router caches from a pool's stats stream."""
    healthy: bool = False
    queued: int = 0                      # requests waiting, all classes
    free_kv: float = 1.0                 # free share of the pool's KV blocks
    ttft_ms: float = 0.0                 # observed time to first token, recent requests (p90)
    utilization: float = 0.0
    adapters: frozenset = frozenset()    # LoRA adapters its workers hold
    report: PoolReport | None = None     # what the latency model fits on (None: nothing yet)


@dataclass(slots=True)
class RouteRequest:
    model: str
    priority: int
    lora: str | None = None
    slo_ms: float | None = None
    exclude: frozenset[str] = frozenset()   # pools that already failed this request (migration)
    prompt_tokens: int = 0               # estimated (the router does not tokenize)
    affinity: int = 0                    # its opening's key (cache_affinity.py); 0: none


class Decision(NamedTuple):
    """A tuple: made on every slo-cost decision, where a frozen dataclass costs a microsecond."""
    pool: str
    rule: str                            # which rule chose it, for traces and tests
    predicted_ttft_ms: float = 0.0       # slo-cost: what the chosen pool's model predicted
