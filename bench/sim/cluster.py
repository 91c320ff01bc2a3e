"""The cluster simulator's event loop: requests arrive, the real router (services/router/routing.py
PoolRouter, in the chosen mode, with its latency models) picks a pool from cached stats, the pools
(bench/sim/fast_pool.py or step_pool.py) compute steps, and every `stats_interval_s` each pool's
stats reach the router, as the WatchPoolStats streams deliver them in a real cluster.

Time is simulated: events are (time, pool) step ends in a heap, merged with the arrivals.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tqdm import tqdm

from bench.sim.accelerators import Accelerator
from bench.sim.fast_pool import FastPool
from bench.sim.step_pool import StepPool
from bench.sim.workload import SimRequest
from services.common.config import BillingConfig
from services.common.percentile import percentile
from services.common.priority import ORDER, priority_name
from services.router.routing import DEFAULT_SLO_MS, PoolRouter, PoolSpec, RouteRequest
from services.scheduler.policy import QoSSettings

MODEL = "llama-3-8b"
MULTIPLIERS = dict(zip(ORDER, BillingConfig().multipliers))    # the ledger's, by class
CACHED_FRACTION = BillingConfig().cached_prompt_fraction      # a cached prompt token's share of the price


@dataclass(slots=True, frozen=True)
class PoolPlan:
    """One pool to simulate: its accelerator and its price per token (cost units)."""
    name: str
    accelerator: Accelerator
    cost_per_token: float
    primary: bool = False              # takes High when the fleet has no GPU pool (as PoolConfig.primary)
    pace: Callable[[float], float] | None = None   # a real run's machine pace (bench/sim/pace.py)


@dataclass(slots=True)
class SimResult:
    mode: str
    requests: int
    cost_units: float
    slo_attainment: dict = field(default_factory=dict)      # class name -> share with TTFT <= SLO
    p50_ttft_ms: dict = field(default_factory=dict)
    p99_ttft_ms: dict = field(default_factory=dict)
    unfinished: int = 0
    utilisation: dict = field(default_factory=dict)         # device -> busy share of the span
    served_share: dict = field(default_factory=dict)        # device -> share of requests
    prediction_error_ms: dict = field(default_factory=dict) # p50/p90 of |actual - predicted| TTFT
    decision_us: dict = field(default_factory=dict)         # mean / p99 of route() here
    preemptions: int = 0
    simulated_s: float = 0.0
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class SimCluster:
    def __init__(self, plans: list[PoolPlan], mode: str, pool_kind: str = "fast",
                 stats_interval_s: float = 0.2, settings: QoSSettings | None = None,
                 slo_ms: dict | None = None, prefix_caching: bool = False):
        """prefix_caching: step pools run the scheduler's prefix cache (requests with prompt_ids)."""
        self.plans = plans
        self.mode = mode
        self.stats_interval_s = stats_interval_s
        self.slo_ms = slo_ms or DEFAULT_SLO_MS
        specs = [PoolSpec(p.name, p.accelerator.device, frozenset({MODEL}), p.cost_per_token, primary=p.primary)
                 for p in plans]
        self.router = PoolRouter(specs, mode=mode, lazy_models=True)
        self.specs = {s.name: s for s in specs}
        if pool_kind == "step":
            self.pools = [StepPool(p.name, p.accelerator, settings, prefix_caching=prefix_caching) for p in plans]
        elif pool_kind == "fast" and not prefix_caching:
            self.pools = [FastPool(p.name, p.accelerator, settings) for p in plans]
        else:
            raise ValueError(f"pool kind {pool_kind!r}{' with prefix caching' if prefix_caching else ''} is not simulated")
        for pool, plan in zip(self.pools, plans):
            pool.pace = plan.pace
        self.index = {pool.name: i for i, pool in enumerate(self.pools)}
        for pool in self.pools:
            pool.first_token = self._first_token_hook(pool, pool.first_token)
        self.errors_ms: list[float] = []

    def _first_token_hook(self, pool, record):
        """The router learns each first token against its prediction, as RequestPath does."""
        router = self.router

        def first_token(request: SimRequest, now: float) -> None:
            record(request, now)
            if request.predicted_ttft_ms is not None:
                actual = (now - request.arrival) * 1000 + request.outside_ms
                router.observe_ttft(pool.name, request.predicted_ttft_ms, actual)
                self.errors_ms.append(abs(actual - request.predicted_ttft_ms))
        return first_token

    def run(self, arrivals: Iterable[SimRequest], duration_s: float, drain_s: float = 600.0,
            label: str = "") -> SimResult:
        started = time.perf_counter()
        router, pools, index = self.router, self.pools, self.index
        events: list = []                       # (time, version, pool index)
        versions = [0] * len(pools)
        all_requests: list[SimRequest] = []
        decision_ns: list[int] = []
        clock = time.perf_counter_ns
        next_stats = 0.0
        with_ttft = self.mode == "cost"
        # A real router adapts its overflow threshold on every pool's update; with hundreds of
        # pools (O(pools) each time) the simulator does it once per round of updates.
        adapt_each = len(pools) <= 64

        changed = [True] * len(pools)        # since the last stats round: an idle pool's stats stand

        def push(i: int, at: float | None) -> None:
            changed[i] = True
            if at is not None:
                versions[i] += 1
                heapq.heappush(events, (at, versions[i], i))

        def advance(until: float) -> None:
            nonlocal next_stats
            while True:
                event_at = events[0][0] if events else float("inf")
                if next_stats <= until and next_stats <= event_at:
                    for i, pool in enumerate(pools):
                        if changed[i]:
                            changed[i] = False
                            router.update(pool.name, pool.report(next_stats, with_ttft), adapt=adapt_each)
                    if not adapt_each:
                        router.adapt_threshold()
                    next_stats += self.stats_interval_s
                    continue
                if event_at > until:
                    return
                at, version, i = heapq.heappop(events)
                if version == versions[i]:
                    push(i, pools[i].step_end(at))

        bar = tqdm(total=round(duration_s), desc=label or self.mode, unit="sim s", leave=False)
        shown = 0
        for request in arrivals:
            advance(request.arrival)
            route = RouteRequest(MODEL, request.priority,
                                 prompt_tokens=request.routed_prompt_tokens or request.prompt_tokens)
            if request.pool:         # routed already: a real run's decision, replayed as it was
                request.predicted_ttft_ms = router.predict_ttft_ms(request.pool, route)
            else:
                t0 = clock()
                decision = router.route(route)
                decision_ns.append(clock() - t0)
                request.pool = decision.pool
                request.predicted_ttft_ms = decision.predicted_ttft_ms or router.predict_ttft_ms(decision.pool, route)
            router.note_dispatch(request.pool, route)
            i = index[request.pool]
            push(i, pools[i].submit(request, request.arrival))
            all_requests.append(request)
            if request.arrival - shown >= 1:
                bar.update(int(request.arrival - shown))
                shown = int(request.arrival)
        bar.close()
        advance(duration_s + drain_s)
        return self._result(all_requests, decision_ns, time.perf_counter() - started)

    def _result(self, requests: list[SimRequest], decision_ns: list[int], wall_s: float) -> SimResult:
        span = max((r.finished_at or r.arrival for r in requests), default=0.0)
        result = SimResult(self.mode, len(requests), 0.0, simulated_s=span, wall_s=wall_s)
        for r in requests:
            if r.finished_at is not None:
                billed = r.prompt_tokens + r.output_tokens - r.cached_tokens * (1 - CACHED_FRACTION)
                result.cost_units += billed * self.specs[r.pool].cost * MULTIPLIERS[r.priority]
            else:
                result.unfinished += 1
        for p in ORDER:
            name = priority_name(p)
            mine = [r for r in requests if r.priority == p]
            ttfts = [r.ttft_ms if r.ttft_ms is not None else float("inf") for r in mine]
            result.slo_attainment[name] = sum(t <= self.slo_ms[p] for t in ttfts) / len(mine) if mine else 1.0
            result.p50_ttft_ms[name] = percentile(ttfts, 0.5) if mine else 0.0
            result.p99_ttft_ms[name] = percentile(ttfts, 0.99) if mine else 0.0
        devices = sorted({p.accelerator.device for p in self.plans})
        for device in devices:
            mine = [pool for pool in self.pools if pool.accelerator.device == device]
            result.utilisation[device] = sum(p.busy_s for p in mine) / (len(mine) * span) if span else 0.0
            names = {p.name for p in mine}
            result.served_share[device] = sum(1 for r in requests if r.pool in names) / max(len(requests), 1)
        if self.errors_ms:
            result.prediction_error_ms = {"p50": percentile(self.errors_ms, 0.5), "p90": percentile(self.errors_ms, 0.9)}
        if decision_ns:
            result.decision_us = {"mean": sum(decision_ns) / len(decision_ns) / 1000,
                                  "p99": percentile(decision_ns, 0.99) / 1000}
        result.preemptions = sum(p.preemptions if not hasattr(p, "batcher") else p.batcher.preemptions
                                 for p in self.pools)
        return result
