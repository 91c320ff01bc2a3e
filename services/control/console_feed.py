"""What the web console shows, as one JSON snapshot a second (services/control/console/ draws it).

Once a second the feed adds a point to the last minute's history (per class: TTFT and end-to-end
P50/P99 over the requests completed in the trailing 60 s, tokens/s), builds the snapshot from
state the router already keeps (its totals, the pool cache refreshed every 200 ms, the SLA
monitor) and wakes the subscribers. A snapshot is built and serialised once per second per view,
however many consoles are open; with none open, only the history point is computed.

Views: "cluster" (the admin key, or auth off) sees everything; a tenant's key sees only its own
tenant: its row, its requests and its SLA contracts, no pool or class internals.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections import deque
from pathlib import Path

from services.common.percentile import percentile
from services.common.priority import ORDER, priority_name

CONSOLE_DIR = Path(__file__).resolve().parent / "console"     # the page that draws the feed
HISTORY_S = 60
TRACE_URL_ENV = "QOS_JAEGER_UI_URL"       # e.g. http://localhost:16686: recent requests link there


def _pct(values: list[float], q: float) -> float:
    return round(percentile(values, q), 1)



def hit_rate(classes) -> float | None:
    """Prompt tokens found in the prefix cache over those looked up (None: none looked up)."""
    queried = sum(c.cache_queried_tokens for c in classes)
    return round(sum(c.cache_hit_tokens for c in classes) / queried, 3) if queried else None

class ConsoleFeed:
    def __init__(self, router, interval_s: float = 1.0):
        self.router = router                  # RouterService: totals, pools, sla, book
        self.interval_s = interval_s
        self.history: deque[dict] = deque(maxlen=HISTORY_S)
        self.seq = 0
        self.tick_event = asyncio.Event()
        self.subscribers = 0
        self._tokens = {p: 0 for p in ORDER}
        self._last_tick = time.monotonic()
        self._cache: dict[str, str] = {}      # view -> JSON of the current seq
        self.closed = False
        self.trace_url = os.environ.get(TRACE_URL_ENV, "").rstrip("/")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.tick(time.time())

    def tick(self, now: float) -> None:
        """A history point; then wake whoever waits for the next snapshot."""
        totals = self.router.totals
        elapsed = max(1e-3, time.monotonic() - self._last_tick)
        self._last_tick = time.monotonic()
        while totals.finished and totals.finished[0][0] < now - HISTORY_S:
            totals.finished.popleft()
        point = {"t": round(now, 3)}
        ttfts: dict[int, list[float]] = {p: [] for p in ORDER}
        e2es: dict[int, list[float]] = {p: [] for p in ORDER}
        for _, priority, ttft_ms, e2e_ms in totals.finished:       # one pass over the minute
            ttfts[priority].append(ttft_ms)
            e2es[priority].append(e2e_ms)
        for p in ORDER:
            ttft, e2e = ttfts[p], e2es[p]
            tokens = totals.by_priority[p].output_tokens
            point[priority_name(p)] = {
                "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99),
                "e2e_p50": _pct(e2e, 0.5), "e2e_p99": _pct(e2e, 0.99),
                "tok_s": round((tokens - self._tokens[p]) / elapsed, 1)}
            self._tokens[p] = tokens
        self.history.append(point)
        self.seq += 1
        self._cache.clear()
        event, self.tick_event = self.tick_event, asyncio.Event()
        event.set()

    def snapshot_json(self, view: str, tenant: str | None) -> str:
        """The current snapshot for a view ("cluster", or a tenant's name), serialised once."""
        key = view if tenant is None else f"tenant:{tenant}"
        if key not in self._cache:
            self._cache[key] = json.dumps(self.snapshot(view, tenant), separators=(",", ":"))
        return self._cache[key]

    async def stream(self, view: str, tenant: str | None):
        """Server-sent events: the current snapshot at once, then one per tick, until close()."""
        self.subscribers += 1
        try:
            while not self.closed:
                yield f"data: {self.snapshot_json(view, tenant)}\n\n"
                await self.tick_event.wait()
        finally:
            self.subscribers -= 1

    def close(self) -> None:
        """The router stops: end every stream now (the page reconnects to another replica)."""
        self.closed = True
        self.tick_event.set()

    # --- the snapshot ----------------------------------------------------------------------------

    def snapshot(self, view: str, tenant: str | None) -> dict:
        r = self.router
        totals = r.totals
        sla = r.sla.reply(tenant)
        snapshot = {
            "seq": self.seq, "t": round(time.time(), 3), "view": view,
            "scope": "cluster" if tenant is None else "tenant",
            "sla": {"objectives": [_objective(o) for o in sla.objectives],
                    "alerts": [_alert(a) for a in sla.alerts]},
            "tenants": self._tenants(tenant),
            "recent": [self._recent(f) for f in reversed(totals.recent) if tenant is None or f.tenant == tenant],
        }
        if tenant is None:
            stats = r.pools.latest_stats()
            snapshot.update({
                "classes": self._classes(stats), "history": list(self.history),
                "pools": [self._pool(s) for s in stats], "routing": r.pools.router.mode,
                "threshold": round(r.pools.router.threshold.value, 1),
                "processes": r.processes.rows(),
                "rejections": [{"priority": p, "reason": reason, "count": n}
                               for (p, reason), n in sorted(totals.rejected.items())]})
        return snapshot

    def _classes(self, stats) -> list[dict]:
        totals, latest = self.router.totals, (self.history[-1] if self.history else {})
        kv_total = sum(s.kv_blocks_total for s in stats)
        rows = []
        for p in ORDER:
            name = priority_name(p)
            per_pool = [c for s in stats for c in s.classes if c.priority == p]
            counters = totals.by_priority[p]
            rows.append({
                "priority": name, "waiting": sum(c.waiting for c in per_pool),
                "running": sum(c.running for c in per_pool), "kv_blocks": sum(c.kv_blocks for c in per_pool),
                "kv_total": kv_total, "kv_cap": per_pool[0].kv_cap if per_pool else 0.0,
                "weight": round(per_pool[0].weight, 2) if per_pool else 0.0,
                "preempted": sum(c.preempted for c in per_pool), "requests": counters.requests,
                "cache_hit_rate": hit_rate(per_pool),
                "completed": counters.completed, "failed": counters.failed,
                **latest.get(name, {"ttft_p50": 0, "ttft_p99": 0, "e2e_p50": 0, "e2e_p99": 0, "tok_s": 0.0})})
        return rows

    def _pool(self, s) -> dict:
        spec = self.router.pools.specs.get(s.pool)
        counters = self.router.totals.by_pool.get(s.pool)
        return {
            "name": s.pool, "device": s.device, "workers": s.workers, "workers_draining": s.workers_draining,
            "draining": s.draining, "desired_workers": s.desired_workers, "min_workers": s.min_workers,
            "max_workers": s.max_workers, "scale_reason": s.scale_reason,
            "cost_per_token": spec.cost if spec else 0.0,
            "cost_units": counters.cost_units if counters else 0.0, "requests": counters.requests if counters else 0,
            "kv_used": s.kv_blocks_used, "kv_total": s.kv_blocks_total, "preemptions": s.preemptions,
            "failovers": s.failovers, "utilization": round(s.utilization, 3),
            "classes": [{"priority": priority_name(c.priority), "waiting": c.waiting, "running": c.running,
                         "kv_blocks": c.kv_blocks, "kv_cap": c.kv_cap, "weight": round(c.weight, 2),
                         "cache_hit_rate": hit_rate([c]), "cache_idle_blocks": c.cache_idle_blocks}
                        for c in s.classes],
            "weight_changes": [{"at": w.at_unix_s, "priority": priority_name(w.priority), "old": w.old_weight,
                                "new": w.new_weight, "utilization": w.utilization, "free_kv": w.free_kv}
                               for w in list(s.weight_changes)[-5:]]}

    def _tenants(self, only: str | None) -> list[dict]:
        totals, book = self.router.totals, self.router.book
        rows = []
        for name, counters in sorted(totals.by_tenant.items()):
            if only is not None and name != only:
                continue
            known = book.tenants.get(name)
            limits = ", ".join(f"{k} {v:g}" for k, v in (("rpm", known.rpm), ("tpm", known.tpm),
                                                           ("streams", known.max_concurrent),
                                                           ("budget", known.budget)) if v is not None) if known else ""
            rows.append({"name": name, "requests": counters.requests, "tokens": counters.output_tokens,
                         "spend": round(counters.cost_units, 2), "limits_hit": totals.limits_hit[name],
                         "limits": limits})
        return rows

    def _recent(self, f) -> dict:
        return {"request_id": f.request_id, "priority": f.priority, "tenant": f.tenant, "pool": f.pool,
                "status": f.status, "ttft_ms": f.ttft_ms, "tokens": f.tokens, "at": f.at,
                "trace_id": f.trace_id,
                "trace_url": f"{self.trace_url}/trace/{f.trace_id}" if self.trace_url and f.trace_id else ""}


def _objective(o) -> dict:
    return {"priority": priority_name(o.priority), "tenant": o.tenant, "objective": o.objective,
            "target": o.target, "observed": o.observed, "has_verdict": o.has_verdict,
            "requests": o.requests, "state": o.state}


def _alert(a) -> dict:
    return {"state": a.state, "priority": priority_name(a.priority), "objective": a.objective,
            "summary": a.summary, "starts_at_unix_s": a.starts_at_unix_s, "ends_at_unix_s": a.ends_at_unix_s,
            "fingerprint": a.fingerprint}
