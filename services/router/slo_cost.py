"""Routing mode "slo-cost" (services/router/routing.py keeps the High and LoRA rules before it):
the cheapest pool whose latency model (latency_model.py) predicts a time to first token within
the request's SLO, x the pool's margin, with KV room; pools of one price taken in turn so that
load spreads; none -> the pool predicted fastest, or for Low the fastest of the cheapest pools
(batch work that is late anyway does not take the fast pools' room). A pool with no step-time
sample yet is judged by the rules' overflow test.

Cost: one prediction (a dozen arithmetic operations) per pool visited, pools visited only among
those serving the model, cheapest price first. With hundreds of pools of one price, two things
keep most decisions short: a lower bound per price tier (no member can beat it) skips a tier
that cannot meet the SLO, and a scan that found none is remembered until the next stats update.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from services.common.priority import LOW, MEDIUM
from services.router.cache_affinity import CacheAffinity
from services.router.latency_model import LatencyModel
from services.router.route_types import Decision, PoolLoad, PoolSpec, RouteRequest


class PoolRouter(Protocol):
    """What slo-cost routing reads of the router that calls it (routing.PoolRouter)."""
    models: dict[str, LatencyModel]
    loads: dict[str, PoolLoad]
    min_free_kv: float
    affinity: CacheAffinity

    def has_room_by_rule(self, pool: PoolSpec, slo: float) -> bool: ...


@dataclass(slots=True)
class PriceTier:
    """The healthy pools of one price (for one model), taken in turn by slo-cost routing."""
    cost: float
    members: list[tuple[PoolSpec, LatencyModel]]
    cursor: int = 0
    epoch: int = 0                       # bumped when a member's predictions may have dropped
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


def cheapest_meeting_slo(router: PoolRouter, request: RouteRequest, tiers: list[PriceTier], slo: float) -> Decision:
    """The first pool, by price and then in turn inside a price, whose predicted time to first
    token (x its margin) meets the SLO with KV room; else the one predicted fastest."""
    priority, prompt = request.priority, request.prompt_tokens
    fastest, fastest_ms = None, float("inf")
    skipped: list[tuple[float, PriceTier]] = []    # (lower bound, tier) of tiers not scanned
    for tier in tiers:
        failed = tier.failed[priority]
        if failed is not None and failed[0] == tier.epoch and prompt >= failed[1] and slo <= failed[2]:
            if failed[3] is not None and failed[4] < fastest_ms:
                fastest, fastest_ms = failed[3], failed[4]
            continue
        bound = _tier_bound(tier, priority, prompt)
        if bound > slo:
            skipped.append((bound, tier))
            continue
        cached = _cached_pool(router, tier, request, slo)
        if cached is not None:
            return cached
        chosen, tier_fastest, tier_ms = _scan(router, tier, priority, prompt, slo)
        if chosen is not None:
            return chosen
        tier.failed[priority] = (tier.epoch, prompt, slo, tier_fastest, tier_ms)
        if tier_ms < fastest_ms:
            fastest, fastest_ms = tier_fastest, tier_ms
    if priority == LOW:
        # Batch work that no pool serves in time waits where it costs least, rather than take
        # the fast pools' room from the classes that wait on their answer.
        failed = tiers[0].failed[priority]
        if failed is not None and failed[0] == tiers[0].epoch and failed[1] == prompt and failed[2] == slo:
            cheapest, cheapest_ms = failed[3], failed[4]          # scanned just now, in this call
        else:
            _, cheapest, cheapest_ms = _scan(router, tiers[0], priority, prompt, -1.0)
        if cheapest is not None:
            return Decision(cheapest.name, "slo-cheapest-late", cheapest_ms / router.models[cheapest.name].margin)
    # None meets the SLO: the fastest, looking into skipped tiers only where their bound says
    # a member could beat the fastest found so far.
    for bound, tier in skipped:
        if bound >= fastest_ms:
            continue
        _, tier_fastest, tier_ms = _scan(router, tier, priority, prompt, -1.0)
        if tier_ms < fastest_ms:
            fastest, fastest_ms = tier_fastest, tier_ms
    if fastest is None:                        # no pool measured and none with room
        return Decision(tiers[-1].members[0][0].name, "slo-fastest")
    return Decision(fastest.name, "slo-fastest", fastest_ms / router.models[fastest.name].margin)


def _cached_pool(router: PoolRouter, tier: PriceTier, request: RouteRequest, slo: float) -> Decision | None:
    """The pool of this tier the request's conversation or system prompt went to last
    (cache_affinity.py), when it meets the SLO with KV room as _scan would judge it: within a
    price, the pool that holds the request's cache comes before the turn order."""
    name = router.affinity.pool(request.affinity)
    if name is None:
        return None
    for pool, model in tier.members:
        if pool.name != name:
            continue
        if not model.known:
            return Decision(name, "slo-cost-cache-affinity") if router.has_room_by_rule(pool, slo) else None
        predicted = model.ttft_ms(request.priority, request.prompt_tokens)
        if predicted * model.margin <= slo and router.loads[name].free_kv >= router.min_free_kv:
            return Decision(name, "slo-cost-cache-affinity", predicted)
        return None
    return None


def _scan(router: PoolRouter, tier: PriceTier, priority: int, prompt: int,
          slo: float) -> tuple[Decision | None, PoolSpec | None, float]:
    """The tier's pools in turn: the first whose expected TTFT meets the SLO with KV room (a
    Decision), else the fastest of them and its expected TTFT."""
    loads = router.loads
    members, start = tier.members, tier.cursor
    count = len(members)
    fastest, fastest_ms = None, float("inf")
    for i in range(start, start + count):
        if i >= count:
            i -= count
        pool, model = members[i]
        if not model.known:                    # nothing measured yet: judged as rule 4 does
            if slo >= 0 and router.has_room_by_rule(pool, slo):
                tier.cursor = i + 1 if i + 1 < count else 0
                return Decision(pool.name, "slo-cost-unmeasured"), None, fastest_ms
            continue
        predicted = model.ttft_ms(priority, prompt)
        expected = predicted * model.margin
        if expected <= slo and loads[pool.name].free_kv >= router.min_free_kv:
            tier.cursor = i + 1 if i + 1 < count else 0
            return Decision(pool.name, "slo-cost", predicted), None, fastest_ms
        if expected < fastest_ms:
            fastest, fastest_ms = pool, expected
    return None, fastest, fastest_ms


def refresh_bounds(tier: PriceTier) -> None:
    """The tier's bounds for the classes slo-cost routes (High keeps its rule)."""
    for priority in (MEDIUM, LOW):
        _compute_bound(tier, priority)


def _compute_bound(tier: PriceTier, priority: int) -> tuple:
    a = b = c = d = margin = float("inf")
    for _, model in tier.members:
        if not model.known:
            tier.bounds[priority] = bound = (tier.epoch, None)
            return bound
        ma, mb, mc, md = model.lower_bound(priority)
        a, b, c, d, margin = min(a, ma), min(b, mb), min(c, mc), min(d, md), min(margin, model.margin)
    tier.bounds[priority] = bound = (tier.epoch, a, b, c, d, margin)
    return bound


def _tier_bound(tier: PriceTier, priority: int, prompt: int) -> float:
    """A lower bound on every member's expected TTFT for this prompt (0 when unknown)."""
    bound = tier.bounds[priority]
    if bound is None or bound[0] != tier.epoch:
        bound = _compute_bound(tier, priority)
    if bound[1] is None:
        return 0.0
    _, a, b, c, d, margin = bound
    one, full = a + b * prompt, c + d * prompt
    return (one if one > full else full) * margin
