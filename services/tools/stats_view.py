"""`qos-serve stats`: the cluster per priority, from the router's Stats RPC, as one table."""
from __future__ import annotations

import asyncio
import sys
import time

import grpc

from services.common.grpc_server import open_channel
from services.common.priority import ORDER, priority_name
from services.common.proto.qos.v1 import router_pb2, router_pb2_grpc


def share(part: int, whole: int) -> str:
    """A percentage, or '-' when there is nothing to divide (prefix caching off, no request yet)."""
    return f"{part / whole:.0%}" if whole else "-"


def render(stats: router_pb2.RouterStats) -> str:
    """The table: one row per priority, then one line per pool."""
    pools = list(stats.pools)
    waiting = {p: 0 for p in ORDER}
    held = {p: 0 for p in ORDER}
    rejected = {p: 0 for p in ORDER}
    queried = {p: 0 for p in ORDER}
    hits = {p: 0 for p in ORDER}
    total_blocks = sum(pool.kv_blocks_total for pool in pools) or 1
    for pool in pools:
        for c in pool.classes:
            waiting[c.priority] += c.waiting
            held[c.priority] += c.kv_blocks
            rejected[c.priority] += c.rejected
            queried[c.priority] += c.cache_queried_tokens
            hits[c.priority] += c.cache_hit_tokens
    weights = {c.priority: c.weight for c in pools[0].classes} if pools else {}
    header = (f"{'priority':<8} {'requests':>8} {'ok':>6} {'failed':>6} {'cancel':>6} "
              f"{'TTFT p50':>9} {'p95':>7} {'p99':>7} {'e2e p50':>8} {'p95':>7} {'p99':>7} "
              f"{'queue':>5} {'KV':>5} {'weight':>6} {'rejected':>8} {'cost':>8} {'cached':>6}")
    lines = [header]
    for s in stats.priorities:
        p = s.priority
        lines.append(
            f"{priority_name(p):<8} {s.requests:>8} {s.completed:>6} {s.failed:>6} {s.cancelled:>6} "
            f"{s.ttft_p50_ms:>7.0f}ms {s.ttft_p95_ms:>5.0f}ms {s.ttft_p99_ms:>5.0f}ms "
            f"{s.e2e_p50_ms:>6.0f}ms {s.e2e_p95_ms:>5.0f}ms {s.e2e_p99_ms:>5.0f}ms "
            f"{waiting[p]:>5} {held[p] / total_blocks:>5.0%} {weights.get(p, 0):>6g} "
            f"{rejected[p]:>8} {s.cost_units:>8.1f} {share(hits[p], queried[p]):>6}")
    for pool in pools:
        scaling = (f" (wants {pool.desired_workers} of {pool.min_workers}..{pool.max_workers}: {pool.scale_reason})"
                   if pool.max_workers > pool.min_workers else "")
        lines.append(f"pool {pool.pool}: {pool.device or '?'} x{pool.workers}{scaling}, policy {pool.policy}, "
                     f"KV {pool.kv_blocks_used}/{pool.kv_blocks_total} blocks, "
                     f"{pool.preemptions} preemptions, {pool.steps} steps, TTFT p90 "
                     f"{pool.ttft_p90_ms:.0f} ms, weight changes {len(pool.weight_changes)}, prefix cache hits "
                     + " / ".join(share(c.cache_hit_tokens, c.cache_queried_tokens) for c in pool.classes)
                     + " (high / medium / low)")
    lines.append(f"overflow threshold: {stats.overflow_threshold:g} queued")
    return "\n".join(lines)


async def call_router(address: str, method: str, request, api_key: str | None = None,
                      ca_file: str | None = None):
    """One unary Router RPC, with the API key as a bearer token (the CLI's views share it)."""
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
    async with open_channel(address, ca_file) as channel:
        return await getattr(router_pb2_grpc.RouterStub(channel), method)(request, timeout=5, metadata=metadata)


async def fetch(address: str, api_key: str | None = None, ca_file: str | None = None) -> router_pb2.RouterStats:
    return await call_router(address, "Stats", router_pb2.StatsRequest(), api_key, ca_file)


def show(address: str, watch: float | None, api_key: str | None = None, ca_file: str | None = None) -> int:
    try:
        if watch is None:
            print(render(asyncio.run(fetch(address, api_key, ca_file))))
            return 0
        while True:
            table = render(asyncio.run(fetch(address, api_key, ca_file)))
            # Clear the screen and redraw in place.
            sys.stdout.write("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + address + "\n" + table + "\n")
            sys.stdout.flush()
            time.sleep(watch)
    except grpc.aio.AioRpcError as exc:
        print(f"qos-serve stats: router {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
