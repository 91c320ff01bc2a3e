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

Mode "slo-cost" keeps rules 0-2 and replaces 3-5: each pool's latency model
(services/router/latency_model.py) predicts the request's time to first token from the pool's last
stats; the cheapest pool whose prediction x margin meets the SLO takes it (pools of one price in
turn, so that load spreads), else the pool with the smallest prediction (Low: the fastest of the
cheapest pools; batch work that is late anyway does not take the fast pools' room). A pool whose model has no
step-time sample yet is judged as rule 4 judges pools.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from services.common.config import ROUTING_MODES
from services.common.priority import HIGH, LOW, MEDIUM
from services.router.latency_model import LatencyModel, PoolReport

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


class Decision(NamedTuple):
    """A tuple: made on every slo-cost decision, where a frozen dataclass costs a microsecond."""
    pool: str
    rule: str                            # which rule chose it, for traces and tests
    predicted_ttft_ms: float = 0.0       # slo-cost: what the chosen pool's model predicted


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
class PriceTier:
    """The healthy pools of one price (for one model), taken in turn by slo-cost routing."""
    cost: float
    members: list[tuple[PoolSpec, LatencyModel]]
    cursor: int = 0
    # A scan in which no pool met (prompt, SLO) for a class: a request of that class with no shorter
    # prompt and no looser SLO cannot be met either, until the next stats update or lower margin
    # (predictions only grow in between, with dispatches). By priority: (epoch, prompt, SLO,
    # fastest pool then, its expected ms). With hundreds of pools of one price, most decisions skip
    # a saturated price tier at once instead of scanning it.
    failed: list = field(default_factory=lambda: [None] * 4)
    # By priority: (epoch, a, b, c, d, smallest margin): no member's expected TTFT for a P-token
    # prompt is below max(a + b P, c + d P) x margin (latency_model.lower_bound), so a tier whose
    # bound misses the SLO, or exceeds the fastest pool found so far, is not scanned. (epoch, None)
    # while a member has no measurement.
    bounds: list = field(default_factory=lambda: [None] * 4)


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
    _by_model: dict[str, list[PoolSpec]] = field(default_factory=dict)
    _by_cost: list[PoolSpec] = field(default_factory=list)
    models: dict[str, LatencyModel] = field(default_factory=dict)
    # Per (model, adapter or None), what _candidates says of the pools that serve it: rebuilt
    # when a pool's health or adapters change, not on every decision.
    _healthy: dict[tuple[str, str | None], Candidates] = field(default_factory=dict)
    _decisions: dict[tuple[str, str], Decision] = field(default_factory=dict)   # immutable, reused
    _epoch: int = 0                      # bumped when predictions may have dropped (PriceTier.failed)
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
        self.loads[name] = load
        self._epoch += 1
        if load.report is not None:
            self.models[name].report(load.report)
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
        stats updates does not all land on one pool."""
        self.loads[name].queued += 1
        if request is not None:
            self.models[name].dispatched(request.priority, request.prompt_tokens)

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
            self._epoch += 1

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
                cached = self._healthy[key] = self._candidates(self._holding(candidates, request))
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

    def _candidates(self, candidates: list[PoolSpec]) -> Candidates:
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
        return Candidates(healthy, gpus, fixed, tiers)

    def _choose(self, request: RouteRequest, candidates: Candidates) -> Decision:
        loads = self.loads
        healthy = candidates.healthy
        if request.priority == HIGH or self.mode != "slo-cost":
            primary = candidates.fixed_primary or self._least_queued(candidates.gpus)
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
            return self._cheapest_meeting_slo(request, candidates.tiers, slo)
        if loads[primary.name].queued < self.threshold.value:
            return self._decision(primary, "primary-under-threshold")
        for pool in healthy:                       # cheapest first
            if pool is not primary and self._has_room_by_rule(pool, slo):
                return self._decision(pool, "overflow-cheapest")
        return self._decision(primary, "queue-on-primary")

    def _has_room_by_rule(self, pool: PoolSpec, slo: float) -> bool:
        load = self.loads[pool.name]
        return load.free_kv >= self.min_free_kv and load.queued <= self.max_queue_for_overflow \
            and load.ttft_ms <= slo

    def _cheapest_meeting_slo(self, request: RouteRequest, tiers: list[PriceTier], slo: float) -> Decision:
        """The first pool, by price and then in turn inside a price, whose predicted time to first
        token (x its margin) meets the SLO with KV room; else the one predicted fastest."""
        priority, prompt = request.priority, request.prompt_tokens
        fastest, fastest_ms = None, float("inf")
        epoch = self._epoch
        skipped: list[tuple[float, PriceTier]] = []    # (lower bound, tier) of tiers not scanned
        for tier in tiers:
            failed = tier.failed[priority]
            if failed is not None and failed[0] == epoch and prompt >= failed[1] and slo <= failed[2]:
                if failed[3] is not None and failed[4] < fastest_ms:
                    fastest, fastest_ms, fastest_model = failed[3], failed[4], self.models[failed[3].name]
                continue
            bound = self._tier_bound(tier, priority, epoch, prompt)
            if bound > slo:
                skipped.append((bound, tier))
                continue
            chosen, tier_fastest, tier_ms = self._scan(tier, priority, prompt, slo)
            if chosen is not None:
                return chosen
            tier.failed[priority] = (epoch, prompt, slo, tier_fastest, tier_ms)
            if tier_ms < fastest_ms:
                fastest, fastest_ms, fastest_model = tier_fastest, tier_ms, self.models[tier_fastest.name]
        if priority == LOW:
            # Batch work that no pool serves in time waits where it costs least, rather than take
            # the fast pools' room from the classes that wait on their answer.
            _, cheapest, cheapest_ms = self._scan(tiers[0], priority, prompt, -1.0)
            if cheapest is not None:
                return Decision(cheapest.name, "slo-cheapest-late", cheapest_ms / self.models[cheapest.name].margin)
        # None meets the SLO: the fastest, looking into skipped tiers only where their bound says
        # a member could beat the fastest found so far.
        for bound, tier in sorted(skipped, key=lambda item: item[0]):
            if bound >= fastest_ms:
                break
            _, tier_fastest, tier_ms = self._scan(tier, priority, prompt, -1.0)
            if tier_ms < fastest_ms:
                fastest, fastest_ms, fastest_model = tier_fastest, tier_ms, self.models[tier_fastest.name]
        if fastest is None:                        # no pool measured and none with room
            return Decision(tiers[-1].members[0][0].name, "slo-fastest")
        return Decision(fastest.name, "slo-fastest", fastest_ms / fastest_model.margin)

    def _scan(self, tier: PriceTier, priority: int, prompt: int, slo: float) -> tuple[Decision | None, PoolSpec | None, float]:
        """The tier's pools in turn: the first whose expected TTFT meets the SLO with KV room (a
        Decision), else the fastest of them and its expected TTFT."""
        loads = self.loads
        members, start = tier.members, tier.cursor
        fastest, fastest_ms = None, float("inf")
        for k, (pool, model) in enumerate(members[start:] + members[:start] if start else members):
            if not model.known:                    # nothing measured yet: judged as rule 4 does
                if slo >= 0 and self._has_room_by_rule(pool, slo):
                    tier.cursor = (start + k + 1) % len(members)
                    return Decision(pool.name, "slo-cost-unmeasured"), None, fastest_ms
                continue
            predicted = model.ttft_ms(priority, prompt)
            expected = predicted * model.margin
            if expected <= slo and loads[pool.name].free_kv >= self.min_free_kv:
                tier.cursor = (start + k + 1) % len(members)
                return Decision(pool.name, "slo-cost", predicted), None, fastest_ms
            if expected < fastest_ms:
                fastest, fastest_ms = pool, expected
        return None, fastest, fastest_ms

    def _tier_bound(self, tier: PriceTier, priority: int, epoch: int, prompt: int) -> float:
        """A lower bound on every member's expected TTFT for this prompt (0 when unknown)."""
        bound = tier.bounds[priority]
        if bound is None or bound[0] != epoch:
            a = b = c = d = margin = float("inf")
            for _, model in tier.members:
                if not model.known:
                    tier.bounds[priority] = bound = (epoch, None)
                    break
                ma, mb, mc, md = model.lower_bound(priority)
                a, b, c, d, margin = min(a, ma), min(b, mb), min(c, mc), min(d, md), min(margin, model.margin)
            else:
                tier.bounds[priority] = bound = (epoch, a, b, c, d, margin)
        if bound[1] is None:
            return 0.0
        _, a, b, c, d, margin = bound
        one, full = a + b * prompt, c + d * prompt
        return (one if one > full else full) * margin

    def _least_queued(self, gpus: list[PoolSpec]) -> PoolSpec:
        """The primary among GPU pools: the least queued (the first among equals)."""
        loads = self.loads
        best = gpus[0]
        for pool in gpus[1:]:
            if loads[pool.name].queued < loads[best.name].queued:
                best = pool
        return best
