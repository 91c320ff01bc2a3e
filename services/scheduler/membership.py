"""Who is in a pool, at run time: the workers named in the config, those that register themselves
(`qos-serve worker --join SCHEDULER`, the Scheduler.Register RPC), and the addresses a DNS name
resolves to (`workers_dns`: a Kubernetes headless Service), re-resolved every few seconds.

A new address gets a link (connected and reconnected in the background) that the batcher can use
once it has answered. An address that vanishes from DNS leaves at once: its sequences go back to
their queues and are recomputed on the others (services/scheduler/batcher.py). A registered
worker that stays unreachable for `FORGET_AFTER_S` is forgotten. Configured workers are never
forgotten: they are the pool's fixed members.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable

from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.worker_link import WorkerLink

log = logging.getLogger(__name__)

DNS_INTERVAL_S = 5.0
FORGET_AFTER_S = 30.0
CONFIG, REGISTERED, DNS = "config", "registered", "dns"

Resolver = Callable[[str, int], Awaitable[list[str]]]   # (host, port) -> ["ip:port", ...]


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every address `host` resolves to now, as host:port strings (IPv6 in brackets)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out = []
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if address not in out:
            out.append(address)
    return out


class Membership:
    def __init__(self, batcher: ContinuousBatcher, link_factory: Callable[[int, str], WorkerLink] = WorkerLink,
                 resolver: Resolver = resolve_dns, dns_interval_s: float = DNS_INTERVAL_S,
                 forget_after_s: float = FORGET_AFTER_S):
        self.batcher = batcher
        self.link_factory = link_factory
        self.resolver = resolver
        self.dns_interval_s = dns_interval_s
        self.forget_after_s = forget_after_s
        self.links: dict[str, WorkerLink] = {}
        self.sources: dict[str, set[str]] = {}
        self.down_since: dict[str, float] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._loops: list[asyncio.Task] = []
        self._indexes = itertools.count()

    def start(self, configured: list[str], dns_name: str | None) -> None:
        for address in configured:
            self.add(address, CONFIG)
        if dns_name:
            self._loops.append(asyncio.create_task(self._follow_dns(dns_name)))
        self._loops.append(asyncio.create_task(self._forget_unreachable()))

    async def stop(self) -> None:
        for task in [*self._loops, *self._tasks.values()]:
            task.cancel()
        for link in self.links.values():
            await link.close()

    def add(self, address: str, source: str) -> bool:
        """Make `address` a member (idempotent); True if it already was one."""
        known = address in self.links
        self.sources.setdefault(address, set()).add(source)
        if not known:
            link = self.link_factory(next(self._indexes), address)
            self.links[address] = link
            self.batcher.add_link(link)
            self._tasks[address] = asyncio.create_task(link.keep_connected())
            log.info("worker %s joins pool %s (%s)", address, self.batcher.pool_name, source)
        return known

    def register(self, address: str) -> bool:
        """Scheduler.Register: a worker announces itself (again)."""
        self.down_since.pop(address, None)
        return self.add(address, REGISTERED)

    async def leave(self, address: str, why: str) -> None:
        """Drop a member: its sequences move to the other workers, its link closes."""
        link = self.links.pop(address, None)
        self.sources.pop(address, None)
        self.down_since.pop(address, None)
        if link is None:
            return
        log.info("worker %s leaves pool %s: %s", address, self.batcher.pool_name, why)
        self.batcher.remove_link(link, f"worker {address} left the pool ({why})")
        task = self._tasks.pop(address, None)
        if task is not None:
            task.cancel()
        await link.close()

    async def sync_dns(self, host: str, port: int) -> None:
        """One resolution: new addresses join, vanished DNS-only members leave."""
        try:
            found = set(await self.resolver(host, port))
        except OSError as exc:      # no answer is not "no workers": keep what we have
            log.warning("workers_dns %s:%d did not resolve (%s); keeping the current members",
                        host, port, exc)
            return
        for address in sorted(found):
            self.add(address, DNS)
        for address, sources in list(self.sources.items()):
            if DNS in sources and address not in found:
                sources.discard(DNS)
                if not sources:
                    await self.leave(address, f"{host} no longer resolves to it")

    async def _follow_dns(self, name: str) -> None:
        host, _, port = name.rpartition(":")
        while True:
            await self.sync_dns(host, int(port))
            await asyncio.sleep(self.dns_interval_s)

    async def _forget_unreachable(self) -> None:
        while True:
            await asyncio.sleep(min(self.dns_interval_s, self.forget_after_s / 3))
            await self.forget_unreachable(time.monotonic())

    async def forget_unreachable(self, now: float) -> None:
        """Registered (not configured, not in DNS) members down for forget_after_s leave."""
        for address, link in list(self.links.items()):
            if link.is_connected or self.sources.get(address) != {REGISTERED}:
                self.down_since.pop(address, None)
                continue
            since = self.down_since.setdefault(address, now)
            if now - since > self.forget_after_s:
                await self.leave(address, f"unreachable for {now - since:.0f} s")
