"""Cost-aware pool choice: which pool serves a request, from cached pool load only (no I/O).

Rules, in order (../shared/DESIGN.md, Routing semantics):
  0. only pools that serve the model (and hold the adapter, when the request names one) are
     candidates; none -> NoPoolError (the router answers FAILED_PRECONDITION naming the model or
     the adapter);
  1. High (real-time)          -> the primary pool among them (the GPU pool, or the configured primary);
  2. a LoRA adapter            -> an NPU pool (or one marked `lora`) holding it, if it has room;
  3. primary queue < threshold -> the primary pool;
  4. otherwise                 -> the cheapest pool with free capacity whose observed time to first
                                  token meets the request's SLO (x-slo-ms, or its class default);
  5. otherwise                 -> queue on the primary.
Prefix caching: where the rules accept several pools (an overflow pool with room, one of several
GPU pools; in slo-cost, within a price), the one the request's conversation or system prompt
went to last comes first (cache_affinity.py).
The overflow threshold adapts: it drops while the cheap pools idle and the primary queues, and
rises while the cheap pools back up.

Mode "slo-cost" keeps rules 0-2 and replaces 3-5 with predicted latency: services/router/slo_cost.py.
The types routing reads and returns live in route_types.py (imported from here as well).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import ROUTING_MODES
from services.common.priority import HIGH, MEDIUM
from services.router.cache_affinity import QUEUE_SLACK, CacheAffinity
from services.router.latency_model import LatencyModel
from services.router.route_types import (DEFAULT_COST, DEFAULT_SLO_MS, Decision, NoPoolError,  # noqa: F401
                                         PoolLoad, PoolSpec, RouteRequest)
from services.router.slo_cost import PriceTier, cheapest_meeting_slo, refresh_bounds


@dataclass(slots=True)
class OverflowThreshold:
    """Primary-pool queue depth above which work overflows to cheaper pools."""
    value: float = 8.0
    minimum: float = 1.0
    maximum: float = 64.0
    step: float = 1.25                   # multiplicative change per adjustment

    def adapt(self, primary_queued: int, cheap_idle: bool, cheap_backed_up: bool) -> None:
        if cheap_backed_up:
            self.value = min(self.maximum, self.value * self.step)
        elif cheap_idle and primary_queued > 0:
            self.value = max(self.minimum, self.value / self.step)


@dataclass(slots=True)
class Candidates:
    """Per model, what the decision needs of its pools; rebuilt when a pool's health changes."""
    healthy: list[PoolSpec]              # cheapest first (all pools, when none is healthy)
    gpus: list[PoolSpec]
    fixed_primary: PoolSpec | None       # the primary when it does not depend on load
    tiers: list[PriceTier]


@dataclass(slots=True)
class PoolRouter:
    pools: list[PoolSpec]
    mode: str = "cost"                   # "cost": the rules above; "primary": everything on the
                                         # primary; "slo-cost": predicted latency (see above)
    threshold: OverflowThreshold = field(default_factory=OverflowThreshold)
    min_free_kv: float = 0.1             # "free capacity": at least this share of KV blocks free
    lazy_models: bool = False            # latency models refreshed at the next prediction (simulator)
    max_queue_for_overflow: int = 4      # a cheap pool queueing more than this is backed up
    loads: dict[str, PoolLoad] = field(default_factory=dict)
    affinity: CacheAffinity = field(default_factory=CacheAffinity)   # where each opening went last
    _by_model: dict[str, list[PoolSpec]] = field(default_factory=dict)
    _by_cost: list[PoolSpec] = field(default_factory=list)
    models: dict[str, LatencyModel] = field(default_factory=dict)
    # Per (model, adapter or None), what _candidates says of the pools that serve it: rebuilt
    # when a pool's health or adapters change, not on every decision.
    _healthy: dict[tuple[str, str | None], Candidates] = field(default_factory=dict)
    _decisions: dict[tuple[str, str], Decision] = field(default_factory=dict)   # immutable, reused
    # The cached price tiers each pool is in (slo_cost.py): a pool's new stats or lower margin
    # make its tiers' bounds and remembered failures stale.
    _tiers_of: dict[str, list[PriceTier]] = field(default_factory=dict)
    _primaries: list[PoolSpec] = field(default_factory=list)
    _cheap: list[PoolSpec] = field(default_factory=list)      # the pools that are not primaries

    def __post_init__(self) -> None:
        if self.mode not in ROUTING_MODES:
            raise ValueError(f"routing mode must be one of {', '.join(ROUTING_MODES)}, got {self.mode!r}")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique: {names}")
        for pool in self.pools:
            if pool.device not in DEFAULT_COST:
                raise ValueError(f"pool {pool.name}: device must be cuda, npu or cpu, got {pool.device!r}")
            self.loads.setdefault(pool.name, PoolLoad())
            self.models[pool.name] = LatencyModel(lazy=self.lazy_models)
        # Precomputed so that route() only walks short lists.
        self._by_cost = sorted(self.pools, key=lambda p: (p.cost, p.name))
        self._primaries = [p for p in self.pools if self._is_primary(p)]
        self._cheap = [p for p in self.pools if not self._is_primary(p)]
        for pool in self._by_cost:
            for model in pool.models:
                self._by_model.setdefault(model, []).append(pool)

    # --- cached state ---------------------------------------------------------------------------

    def update(self, name: str, load: PoolLoad, adapt: bool = True) -> None:
        """A pool's new stats (from its stats stream); also adapts the overflow threshold (with
        many pools, a caller may do that once per round of updates: adapt_threshold())."""
        old = self.loads[name]
        if old.healthy != load.healthy or old.adapters != load.adapters:
            self._healthy.clear()
            self._tiers_of.clear()
        self.loads[name] = load
        if load.report is not None:
            self.models[name].report(load.report)
        self._touch(name)
        if adapt:
            self.adapt_threshold()

    def adapt_threshold(self) -> None:
        primaries = self._primaries
        cheap = [p for p in self._cheap if self.loads[p.name].healthy]
        if not primaries or not cheap:
            return
        primary_queued = min(self.loads[p.name].queued for p in primaries)
        cheap_idle = all(self.loads[p.name].queued == 0 and self.loads[p.name].utilization < 0.5
                         for p in cheap)
        cheap_backed_up = all(self.loads[p.name].queued > self.max_queue_for_overflow for p in cheap)
        self.threshold.adapt(primary_queued, cheap_idle, cheap_backed_up)

    def note_dispatch(self, name: str, request: RouteRequest | None = None) -> None:
        """A request was just sent to `name`: count it as queued (and its prompt as work ahead of
        the next of its class) until the pool's next stats, so a burst arriving between two
        stats updates does not all land on one pool; and remember where its opening went."""
        self.loads[name].queued += 1
        if request is not None:
            self.models[name].dispatched(request.priority, request.prompt_tokens)
            self.affinity.remember(request.affinity, name)

    def predict_ttft_ms(self, name: str, request: RouteRequest) -> float | None:
        """The pool's model's prediction for the request (None before its first step sample)."""
        model = self.models[name]
        return model.ttft_ms(request.priority, request.prompt_tokens) if model.known else None

    def observe_ttft(self, name: str, predicted_ms: float, actual_ms: float) -> None:
        """What a request's first token took on `name`, against what was predicted: the margin."""
        model = self.models[name]
        before = model.margin
        model.observe(predicted_ms, actual_ms)
        if model.margin < before:
            self._touch(name)

    def _touch(self, name: str) -> None:
        """The pool's predictions may have dropped: its tiers start a new epoch; the router (not
        the simulator, whose thousand pools report far more often than it decides) recomputes
        their bounds now, off the request path."""
        for tier in self._tiers_of.get(name, ()):
            tier.epoch += 1
            if not self.lazy_models:
                refresh_bounds(tier)

    def _is_primary(self, pool: PoolSpec) -> bool:
        has_gpu = any(p.device == "cuda" for p in self.pools)
        return pool.device == "cuda" if has_gpu else pool.primary

    # --- the decision ----------------------------------------------------------------------------

    def _decision(self, pool: PoolSpec, rule: str) -> Decision:
        key = (pool.name, rule)
        decision = self._decisions.get(key)
        if decision is None:
            decision = self._decisions[key] = Decision(pool.name, rule)
        return decision

    def route(self, request: RouteRequest) -> Decision:
        candidates = self._by_model.get(request.model)
        if not candidates:
            raise NoPoolError(f"model {request.model!r} is not served by any pool")
        if not request.exclude:
            # The common case: every pool of the model (holding the adapter) is a candidate; the
            # healthy ones are cached.
            key = (request.model, request.lora)
            cached = self._healthy.get(key)
            if cached is None:
                cached = self._healthy[key] = self._candidates(self._holding(candidates, request), cache=True)
            return self._choose(request, cached)
        if request.lora:
            candidates = self._holding(candidates, request)
        if request.exclude:
            candidates = [p for p in candidates if p.name not in request.exclude]
            if not candidates:
                raise NoPoolError(f"no other pool serves model {request.model!r} "
                                  f"(tried {', '.join(sorted(request.exclude))})")
        return self._choose(request, self._candidates(candidates))

    def _holding(self, candidates: list[PoolSpec], request: RouteRequest) -> list[PoolSpec]:
        """The pools that hold the request's adapter (all, without one)."""
        if not request.lora:
            return candidates
        holding = [p for p in candidates if request.lora in self.loads[p.name].adapters]
        if not holding:
            raise NoPoolError(f"LoRA adapter {request.lora!r} is not loaded in any pool serving model "
                              f"{request.model!r}")
        return holding

    def _candidates(self, candidates: list[PoolSpec], cache: bool = False) -> Candidates:
        """The healthy candidates (all, when none is), the GPU pools among them, the primary when
        it does not depend on load (no GPU pool: the marked primary, else the priciest), and the
        healthy pools grouped by price."""
        loads = self.loads
        healthy = [p for p in candidates if loads[p.name].healthy] or candidates
        gpus = [p for p in healthy if p.device == "cuda"]
        fixed = None if gpus else next((p for p in healthy if p.primary), healthy[-1])
        tiers: list[PriceTier] = []
        for pool in healthy:                       # cheapest first already
            if not tiers or tiers[-1].cost != pool.cost:
                tiers.append(PriceTier(pool.cost, []))
            tiers[-1].members.append((pool, self.models[pool.name]))
            if cache:
                self._tiers_of.setdefault(pool.name, []).append(tiers[-1])
        return Candidates(healthy, gpus, fixed, tiers)

    def _choose(self, request: RouteRequest, candidates: Candidates) -> Decision:
        loads = self.loads
        healthy = candidates.healthy
        if request.priority == HIGH or self.mode != "slo-cost":
            primary = candidates.fixed_primary or self._least_queued(candidates.gpus, request.affinity)
            if request.priority == HIGH:
                return self._decision(primary, "high-to-primary")
            if self.mode == "primary":
                return self._decision(primary, "primary-only")
        if request.lora:
            for pool in healthy:
                if (pool.device == "npu" or pool.lora) and loads[pool.name].free_kv >= self.min_free_kv:
                    return self._decision(pool, "lora-to-npu")
        slo = request.slo_ms if request.slo_ms else DEFAULT_SLO_MS.get(request.priority, DEFAULT_SLO_MS[MEDIUM])
        if self.mode == "slo-cost":
            return cheapest_meeting_slo(self, request, candidates.tiers, slo)
        if loads[primary.name].queued < self.threshold.value:
            return self._decision(primary, "primary-under-threshold")
        cached = self.affinity.pool(request.affinity)
        for pool in healthy:                       # where its conversation went, if it has room
            if pool.name == cached and pool is not primary and self.has_room_by_rule(pool, slo):
                return self._decision(pool, "overflow-cache-affinity")
        for pool in healthy:                       # cheapest first
            if pool is not primary and self.has_room_by_rule(pool, slo):
                return self._decision(pool, "overflow-cheapest")
        return self._decision(primary, "queue-on-primary")

    def has_room_by_rule(self, pool: PoolSpec, slo: float) -> bool:
        """Rule 4's test: free KV, a short queue, observed TTFT within the SLO."""
        load = self.loads[pool.name]
        return load.free_kv >= self.min_free_kv and load.queued <= self.max_queue_for_overflow \
            and load.ttft_ms <= slo

    def _least_queued(self, gpus: list[PoolSpec], affinity: int = 0) -> PoolSpec:
        """The primary among GPU pools: the least queued (the first among equals), unless the
        request's conversation went to another that is at most QUEUE_SLACK requests behind it."""
        loads = self.loads
        best = gpus[0]
        for pool in gpus[1:]:
            if loads[pool.name].queued < loads[best.name].queued:
                best = pool
        cached = self.affinity.pool(affinity)
        if cached is not None and cached != best.name:
            for pool in gpus:
                if pool.name == cached and loads[pool.name].queued <= loads[best.name].queued + QUEUE_SLACK:
                    return pool
        return best
