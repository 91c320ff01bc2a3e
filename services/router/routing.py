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
The overflow threshold adapts: it drops while the cheap pools idle and the primary queues, and
rises while the cheap pools back up.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.priority import HIGH, LOW, MEDIUM

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


@dataclass(slots=True)
class RouteRequest:
    model: str
    priority: int
    lora: str | None = None
    slo_ms: float | None = None
    exclude: frozenset[str] = frozenset()   # pools that already failed this request (migration)


@dataclass(slots=True, frozen=True)
class Decision:
    pool: str
    rule: str                            # which rule chose it, for traces and tests


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
class PoolRouter:
    pools: list[PoolSpec]
    mode: str = "cost"                   # "cost": the rules above; "primary": everything on the primary
    threshold: OverflowThreshold = field(default_factory=OverflowThreshold)
    min_free_kv: float = 0.1             # "free capacity": at least this share of KV blocks free
    max_queue_for_overflow: int = 4      # a cheap pool queueing more than this is backed up
    loads: dict[str, PoolLoad] = field(default_factory=dict)
    _by_model: dict[str, list[PoolSpec]] = field(default_factory=dict)
    _by_cost: list[PoolSpec] = field(default_factory=list)
    # Per model, what _healthy_and_gpus says of all its pools: rebuilt after a stats update, not
    # on every decision.
    _healthy: dict[str, tuple[list[PoolSpec], list[PoolSpec], PoolSpec | None]] = field(default_factory=dict)
    _decisions: dict[tuple[str, str], Decision] = field(default_factory=dict)   # immutable, reused

    def __post_init__(self) -> None:
        if self.mode not in ("cost", "primary"):
            raise ValueError(f"routing mode must be cost or primary, got {self.mode!r}")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique: {names}")
        for pool in self.pools:
            if pool.device not in DEFAULT_COST:
                raise ValueError(f"pool {pool.name}: device must be cuda, npu or cpu, got {pool.device!r}")
            self.loads.setdefault(pool.name, PoolLoad())
        # Precomputed so that route() only walks short lists.
        self._by_cost = sorted(self.pools, key=lambda p: (p.cost, p.name))
        for pool in self._by_cost:
            for model in pool.models:
                self._by_model.setdefault(model, []).append(pool)

    # --- cached state ---------------------------------------------------------------------------

    def update(self, name: str, load: PoolLoad) -> None:
        """A pool's new stats (from its stats stream); also adapts the overflow threshold."""
        self.loads[name] = load
        self._healthy.clear()
        primaries = [p for p in self.pools if self._is_primary(p)]
        cheap = [p for p in self.pools if not self._is_primary(p) and self.loads[p.name].healthy]
        if not primaries or not cheap:
            return
        primary_queued = min(self.loads[p.name].queued for p in primaries)
        cheap_idle = all(self.loads[p.name].queued == 0 and self.loads[p.name].utilization < 0.5
                         for p in cheap)
        cheap_backed_up = all(self.loads[p.name].queued > self.max_queue_for_overflow for p in cheap)
        self.threshold.adapt(primary_queued, cheap_idle, cheap_backed_up)

    def note_dispatch(self, name: str) -> None:
        """A request was just sent to `name`: count it as queued until the pool's next stats, so a
        burst arriving between two stats updates does not all land on one pool."""
        self.loads[name].queued += 1

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
        if not request.lora and not request.exclude:
            # The common case: every pool of the model is a candidate; its healthy ones are cached.
            cached = self._healthy.get(request.model)
            if cached is None:
                cached = self._healthy[request.model] = self._healthy_and_gpus(candidates)
            return self._choose(request, *cached)
        if request.lora:
            candidates = [p for p in candidates if request.lora in self.loads[p.name].adapters]
            if not candidates:
                raise NoPoolError(f"LoRA adapter {request.lora!r} is not loaded in any pool serving model "
                                  f"{request.model!r}")
        if request.exclude:
            candidates = [p for p in candidates if p.name not in request.exclude]
            if not candidates:
                raise NoPoolError(f"no other pool serves model {request.model!r} "
                                  f"(tried {', '.join(sorted(request.exclude))})")
        return self._choose(request, *self._healthy_and_gpus(candidates))

    def _healthy_and_gpus(self, candidates: list[PoolSpec]) -> tuple[list[PoolSpec], list[PoolSpec],
                                                                      PoolSpec | None]:
        """The healthy candidates (all, when none is), the GPU pools among them, and the primary
        when it does not depend on load (no GPU pool: the marked primary, else the priciest)."""
        loads = self.loads
        healthy = [p for p in candidates if loads[p.name].healthy] or candidates
        gpus = [p for p in healthy if p.device == "cuda"]
        fixed = None if gpus else next((p for p in healthy if p.primary), healthy[-1])
        return healthy, gpus, fixed

    def _choose(self, request: RouteRequest, healthy: list[PoolSpec], gpus: list[PoolSpec],
                fixed_primary: PoolSpec | None) -> Decision:
        loads = self.loads
        primary = fixed_primary or self._least_queued(gpus)

        if request.priority == HIGH:
            return self._decision(primary, "high-to-primary")
        if self.mode == "primary":
            return self._decision(primary, "primary-only")
        if request.lora:
            for pool in healthy:
                if (pool.device == "npu" or pool.lora) and loads[pool.name].free_kv >= self.min_free_kv:
                    return self._decision(pool, "lora-to-npu")
        if loads[primary.name].queued < self.threshold.value:
            return self._decision(primary, "primary-under-threshold")
        slo = request.slo_ms if request.slo_ms else DEFAULT_SLO_MS.get(request.priority, DEFAULT_SLO_MS[MEDIUM])
        for pool in healthy:                       # cheapest first
            if pool is primary:
                continue
            load = loads[pool.name]
            if load.free_kv >= self.min_free_kv and load.queued <= self.max_queue_for_overflow \
                    and load.ttft_ms <= slo:
                return self._decision(pool, "overflow-cheapest")
        return self._decision(primary, "queue-on-primary")

    def _least_queued(self, gpus: list[PoolSpec]) -> PoolSpec:
        """The primary among GPU pools: the least queued (the first among equals)."""
        loads = self.loads
        best = gpus[0]
        for pool in gpus[1:]:
            if loads[pool.name].queued < loads[best.name].queued:
                best = pool
        return best
