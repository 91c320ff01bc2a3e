"""A run's clients (`workload`) and the faults that come on a timer rather than at a point of the
step protocol (`chaos`): process crashes, worker drains, adapter loads and unloads, a scheduler
drain, late registrations, DNS members leaving and coming back. All drawn from the run's seed."""
from __future__ import annotations

import asyncio
import dataclasses

import grpc

from services.common.errors import ServiceError
from services.common.priority import LOW, ORDER
from tests.sim.clients import Client, ClientSpec

TICK_S = 0.2


def workload(sim) -> list[Client]:
    rng, faults = sim.rng, sim.faults
    prefixes = [[rng.randrange(3, 200) for _ in range(rng.randint(0, 3) * sim.block_size)] for _ in range(3)]
    adapters = ["a1", "a2"] if faults.has("adapters") else ["a1"]
    clients = []
    count = rng.randint(4, 30)
    burst = rng.uniform(0, faults.quiet_at)
    for i in range(count):
        arrival = burst + rng.uniform(0, 0.05) if rng.random() < 0.3 else rng.uniform(0, faults.quiet_at)
        priority = rng.choice(ORDER)
        streaming = priority == LOW and rng.random() < 0.15
        prompt = rng.choice(prefixes) + [rng.randrange(3, 200) for _ in range(rng.randint(1, 24))]
        if streaming:
            prompt += [rng.randrange(3, 200) for _ in range(rng.randint(0, 40))]
        cancel = None
        if faults.has("cancel") and rng.random() < 0.3:
            cancel = rng.choice([rng.uniform(0, 0.02), rng.uniform(0, 2.0), rng.uniform(2.0, 8.0)])
        clients.append(Client(sim, ClientSpec(
            seq_id=i + 1, arrival=arrival, priority=priority, tenant=rng.choice(["", "t1", "t2"]),
            prompt=prompt, max_tokens=rng.randint(1, 40), seed=rng.choice([None, rng.randrange(1 << 20)]),
            ignore_eos=rng.random() < 0.3,
            stop=[chr(97 + rng.randrange(26)) + chr(97 + rng.randrange(26))] if rng.random() < 0.15 else [],
            lora=rng.choice(adapters) if rng.random() < 0.2 else "", streaming=streaming,
            stream_interval=rng.choice([1, 1, 3]), cancel_after=cancel)))
    if sim.tiers:
        # Long prefixes that come back after the pools evicted them (from the tiers' own draws, so
        # a seed's run without tiers is unchanged).
        draw, size = sim.tier_rng, sim.block_size
        shared = [[draw.randrange(3, 200) for _ in range(draw.randint(2, 6) * size)] for _ in range(2)]
        clients = [Client(sim, dataclasses.replace(c.spec, prompt=draw.choice(shared) + c.spec.prompt))
                   if not c.spec.streaming and draw.random() < 0.6 else c for c in clients]
    return clients


async def chaos(sim) -> None:
    rng, faults, loop = sim.rng, sim.faults, sim.loop
    late = list(sim.late)
    while loop.now < faults.quiet_at:
        await asyncio.sleep(rng.uniform(0.5, 1.5) * TICK_S)
        now = loop.now
        alive = [w for w in sim.workers if w.alive]
        if alive and faults.now("crash", now, "process"):
            sim.crash(rng.choice(alive), "process")
        if alive and faults.now("drain_worker", now, "process"):
            asyncio.ensure_future(drain_worker(sim, rng.choice(alive)))
        if faults.now("adapters", now, "pool"):
            asyncio.ensure_future(adapter_change(sim))
        if faults.now("scheduler_drain", now, "pool"):
            sim.drain.begin()
        if late and faults.now("late_register", now, "pool"):
            asyncio.ensure_future(keep_registering(sim, late.pop(0)))
        if sim.dns and faults.now("dns_leave", now, "pool"):
            address = rng.choice(sorted(sim.dns))
            sim.dns.discard(address)
            loop.call_later(rng.uniform(0.5, 4.0), sim.dns.add, address)
    for address in late:            # every worker is in the pool once faults stop
        asyncio.ensure_future(keep_registering(sim, address))


async def keep_registering(sim, address: str) -> None:
    """`qos-serve worker --join`: Register every 2 s while the process lives and does not drain
    (services/worker/server.py join_pool)."""
    worker = sim.network.workers[address]
    while True:
        if worker.alive and not worker.draining:
            sim.membership.register(address)
        await asyncio.sleep(2.0)


async def drain_worker(sim, worker) -> None:
    """SIGTERM: the worker takes no new sequences, ends its stream once it holds none, exits;
    a new process starts at its address a little later."""
    generation = worker.generation
    worker.draining = True
    for _ in range(100):
        if worker.session is None or worker.generation != generation:
            break
        await asyncio.sleep(0.1)
    if worker.generation == generation and worker.alive:
        sim.crash(worker, "drained", restart_after=sim.rng.uniform(0.2, 2.0))


async def adapter_change(sim) -> None:
    rng = sim.rng
    name = rng.choice(["a1", "a2"])
    try:
        if rng.random() < 0.6:
            await sim.pool_adapters.load(name, f"/a/{name}-{rng.randrange(100)}")
        else:
            await sim.pool_adapters.unload(name)
    except (ServiceError, grpc.aio.AioRpcError) as exc:
        sim.trace.append((round(sim.loop.now, 6), "adapter_refused", name, type(exc).__name__))
