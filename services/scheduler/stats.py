"""What a scheduler tells the world about its pool: the PoolStats message (GetPoolStats,
WatchPoolStats, the router's cache) and the Prometheus gauges read at scrape time."""
from __future__ import annotations

from collections import Counter

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.percentile import percentile
from services.common.priority import ORDER, Priority, priority_name
from services.common.proto.qos.v1 import scheduler_pb2
from services.scheduler.autoscale import PoolSignals, ScaleAdvisor
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.monitor import ResourceMonitor


def kv_blocks_by_priority(b: ContinuousBatcher) -> Counter:
    """KV blocks each class holds, over the pool's workers."""
    held: Counter = Counter()
    for link in b.workers:
        if link.pool is not None:
            held.update(link.pool.holdings())
    return held


def running_by_priority(b: ContinuousBatcher) -> Counter:
    return Counter(r.priority for requests in b.running.values() for r in requests)


def kv_blocks_in_use(b: ContinuousBatcher) -> tuple[int, int]:
    """KV blocks held and KV blocks in all, over the pool's connected workers (draining ones too)."""
    pools = [l.pool for l in b.links if l.is_connected and l.info is not None and l.pool]
    return sum(p.num_used for p in pools), sum(p.num_blocks for p in pools)


def cache_by_priority(b: ContinuousBatcher) -> tuple[Counter, Counter]:
    """Prefix caching, over the pool's workers: evictions since they connected and idle cached
    blocks now, per class (the class that held the block last). Empty with caching off."""
    evictions, idle = Counter(), Counter()
    if b.prefix_cache is not None:
        for link in b.workers:
            if link.pool is not None:
                evictions.update(link.pool.evictions)
                idle.update({p: link.pool.idle(p) for p in ORDER})
    return evictions, idle

def pool_stats(name: str, model: str, batcher: ContinuousBatcher, monitor: ResourceMonitor | None,
               rejected: Counter, draining: bool, advisor: ScaleAdvisor) -> scheduler_pb2.PoolStats:
    b, policy = batcher, batcher.policy
    connected = [l for l in b.links if l.is_connected and l.info is not None]
    held = kv_blocks_by_priority(b)
    running = running_by_priority(b)
    weights = policy.weights()
    info = next((l.info for l in b.links if l.info is not None), None)
    prefill_left = prefill_backlog(b)
    evictions, idle = cache_by_priority(b)
    cache = b.prefix_cache
    kv_used, kv_total = kv_blocks_in_use(b)
    return scheduler_pb2.PoolStats(
        pool=name, model=model, policy=policy.name, draining=draining,
        device=info.device_type if info else "", workers=len(connected),
        workers_draining=sum(1 for l in connected if l.index in b.workers.draining),
        failovers=sum(b.failovers.values()), members=[scheduler_pb2.WorkerState(
            address=l.address, connected=l.is_connected, draining=l.index in b.workers.draining,
            running=len(b.running.get(l.index, ())), kv_blocks_total=l.pool.num_blocks if l.pool else 0,
            kv_blocks_used=l.pool.num_used if l.pool else 0, admitted=b.planner.admitted[l.index],
            dtype=l.info.dtype if l.info else "")
            for l in b.links],
        max_context=info.max_context if info else 0,
        block_size=info.block_size if info else 0,
        kv_blocks_total=kv_total, kv_blocks_used=kv_used,
        steps=b.steps, preemptions=b.preemptions, cut_ins=b.cut_ins.steps,
        ttft_p90_ms=percentile(b.recent_ttft_ms, 0.9),
        utilization=monitor.utilization if monitor else 0.0,
        classes=[scheduler_pb2.ClassStats(
            priority=p, waiting=policy.waiting(p), running=running[p], kv_blocks=held[p],
            output_tokens=b.output_tokens[p], weight=weights[p], kv_cap=policy.kv_cap(p),
            served_tokens=b.served_tokens[p], kv_blocks_peak=b.kv_peak[p],
            rejected=rejected[p], preempted=b.preempted_by_priority[p],
            recomputed_tokens=b.planner.recomputed_tokens[p],
            waiting_tokens=prefill_left[p],
            cache_queried_tokens=cache.queried[p] if cache else 0, cache_hit_tokens=cache.hits[p] if cache else 0,
            cache_evictions=evictions[p], cache_idle_blocks=idle[p]) for p in ORDER],
        weight_changes=[scheduler_pb2.WeightChange(
            at_unix_s=c.at, priority=c.priority, old_weight=c.old, new_weight=c.new,
            utilization=c.utilization, free_kv=c.free_kv)
            for c in (monitor.changes if monitor else ())],
        adapters=sorted(frozenset().union(*(l.adapters for l in connected))),
        step_seconds=b.totals.step_seconds, worker_steps=b.totals.worker_steps,
        step_tokens=b.totals.step_tokens, step_kv_tokens=b.totals.step_kv_tokens, finished=b.finished,
        max_step_tokens=b.planner.max_step_tokens, max_running=b.planner.max_running,
        desired_workers=advisor.desired, min_workers=advisor.min_workers, max_workers=advisor.max_workers,
        scale_reason=advisor.reason)


def prefill_backlog(batcher: ContinuousBatcher) -> Counter:
    """Per class, the prompt tokens still to compute: queued requests' and the rest of running
    ones' (a decoding sequence's one pending token is not prefill)."""
    policy, left = batcher.policy, Counter()
    for lane in policy.lanes:
        for request in policy.queue(lane):
            left[request.priority] += request.pending
    for requests in batcher.running.values():
        for request in requests:
            if request.pending > 1:
                left[request.priority] += request.pending
    return left


def scale_signals(batcher: ContinuousBatcher, max_running: int) -> PoolSignals:
    """What the autoscaling rule reads: workers serving (connected, not draining), backlog, KV."""
    b, policy = batcher, batcher.policy
    serving = [l for l in b.links if l.is_connected and l.pool and l.index not in b.workers.draining]
    return PoolSignals(workers=len(serving), high_waiting=policy.waiting(Priority.HIGH),
                       waiting=sum(policy.waiting(p) for p in ORDER),
                       running=sum(running_by_priority(b).values()), max_running=max_running,
                       kv_used=sum(l.pool.num_used for l in serving), kv_total=sum(l.pool.num_blocks for l in serving))


def scale_metrics(pool: str, batcher: ContinuousBatcher, advisor: ScaleAdvisor):
    """`qos_desired_workers{pool}` (what KEDA scales a worker Deployment on), the pool's limits,
    and its backlog per class."""
    for name, text, value in [("qos_desired_workers", "Workers the pool wants now (autoscaling)", advisor.desired),
                              ("qos_min_workers", "Fewest workers autoscaling keeps", advisor.min_workers),
                              ("qos_max_workers", "Most workers autoscaling asks for", advisor.max_workers)]:
        family = GaugeMetricFamily(name, text, labels=["pool"])
        family.add_metric([pool], value)
        yield family
    backlog = GaugeMetricFamily("qos_backlog", "Requests waiting, by class", labels=["pool", "priority"])
    for p in ORDER:
        backlog.add_metric([pool, priority_name(p)], batcher.policy.waiting(p))
    yield backlog


def state_metrics(batcher: ContinuousBatcher):
    """Per-class gauges and counters, computed from the batcher's state at scrape time."""
    b, policy = batcher, batcher.policy
    running, held, weights = running_by_priority(b), kv_blocks_by_priority(b), policy.weights()
    gauges = {
        "qos_queue_depth": ("Requests waiting", lambda p: policy.waiting(p)),
        "qos_running": ("Requests holding KV blocks", lambda p: running[p]),
        "qos_kv_blocks": ("KV blocks held", lambda p: held[p]),
        "qos_kv_blocks_peak": ("Most KV blocks held on one worker", lambda p: b.kv_peak[p]),
        "qos_weight": ("Fair-queueing weight", lambda p: weights[p]),
        "qos_kv_cap_share": ("KV cap, share of a worker's blocks", lambda p: policy.kv_cap(p)),
    }
    evictions, idle = cache_by_priority(b)
    cache = b.prefix_cache
    tiers = [link.pool.tier for link in b.workers if getattr(link.pool, "tier", None) is not None]
    if cache is not None:
        gauges["qos_cache_idle_blocks"] = ("Idle cached KV blocks (prefix caching), by the class that held "
                                           "them last", lambda p: idle[p])
    if tiers:
        gauges["qos_kv_tier_blocks"] = ("Blocks the workers' second KV tiers hold, by the class that held "
                                        "them last", lambda p: sum(t.held(p) for t in tiers))
    for name, (text, read) in gauges.items():
        family = GaugeMetricFamily(name, text, labels=["priority"])
        for p in ORDER:
            family.add_metric([priority_name(p)], read(p))
        yield family
    for name, text, values in [("qos_tokens_served", "Prefill + decode tokens computed", b.served_tokens),
                               ("qos_preemptions", "Sequences preempted", b.preempted_by_priority),
                               ("qos_tokens_recomputed", "Tokens preempted sequences had computed, "
                                "to be computed again", b.planner.recomputed_tokens),
                               *([("qos_cache_queried_tokens", "Prompt tokens looked up in the prefix cache "
                                   "(first admissions)", cache.queried),
                                  ("qos_cache_hit_tokens", "Prompt tokens found in the prefix cache (not "
                                   "computed)", cache.hits),
                                  ("qos_cache_evictions", "Idle cached KV blocks evicted, by the class that "
                                   "held them last", evictions),
                                  ("qos_cache_prefix_waits", "Requests that waited for a prefix another "
                                   "sequence was computing", cache.waited),
                                  ("qos_kv_tier_saved_blocks", "Evicted blocks copied to a second KV tier",
                                   cache.tier_saved),
                                  ("qos_kv_tier_loaded_blocks", "Blocks copied back from a second KV tier "
                                   "instead of computed", cache.tier_loaded),
                                  ("qos_kv_tier_dropped_blocks", "Blocks a second KV tier let go for room",
                                   cache.tier_dropped),
                                  ("qos_kv_tier_hit_tokens", "Prompt tokens loaded from a second KV tier "
                                   "(part of qos_cache_hit_tokens)", cache.tier_hits)] if cache is not None else [])]:
        family = CounterMetricFamily(name, text, labels=["priority"])
        for p in ORDER:
            family.add_metric([priority_name(p)], values[p])
        yield family
    failovers = CounterMetricFamily("qos_failovers", "Sequences moved off a worker that failed or "
                                    "left, to be recomputed on another", labels=["reason"])
    for reason in ("worker_failed", "left", "broken_answer"):
        failovers.add_metric([reason], b.failovers[reason])
    yield failovers
    yield CounterMetricFamily("qos_worker_quarantines", "Workers taken out of the pool for a while "
                              "because an answer did not match its plan", value=sum(b.quarantines.values()))
    yield CounterMetricFamily("qos_cut_in_steps", "Steps run inside another on a worker (High "
                              "requests started mid-step)", value=b.cut_ins.steps)
    yield GaugeMetricFamily("qos_workers", "Workers connected to the pool",
                            value=sum(1 for link in b.links if link.is_connected))
