"""One simulated run of one pool, all drawn from its seed: `simulate(seed)`.

The pool is the real thing: ContinuousBatcher (its run() loop, planner, policy, prefix cache,
streaming windows, cut-ins, failover), Admission, PoolAdapters, Membership (configured, DNS and
registered workers) and WorkerLink, whose gRPC calls reach simulated workers (transport.py,
worker.py). Clients (clients.py) submit, read and cancel. Faults (faults.py) come until
`quiet_at`; then every client must have ended within a bound, and nothing may be left held.
Invariants (invariants.py) are checked after every iteration of the event loop.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from dataclasses import dataclass, field

from services.common.drain import Drain
from services.common.priority import HIGH, LOW, MEDIUM, ORDER
from services.common.stream_window import StreamWindow
from services.scheduler.admission import Admission
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.long_context import StreamSettings
from services.scheduler.membership import Membership
from services.scheduler.policy import QoSSettings, create_policy
from services.scheduler.pool_adapters import PoolAdapters
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.worker_link import WorkerLink
from tests.sim.chaos import chaos, workload
from tests.sim.clock import Stuck, VirtualLoop, virtual_time
from tests.sim.faults import Faults
from tests.sim.invariants import Invariants, Violation
from tests.sim.transport import FakeTrust, Network
from tests.sim.worker import SimWorker

SETTLE_S = 40.0         # after quiet_at, the most any client may still take to end


@dataclass
class Outcome:
    seed: int
    ok: bool
    failure: str = ""
    virtual_s: float = 0.0
    steps: int = 0
    clients: int = 0
    completed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    digest: str = ""            # of the run's trace: equal for two runs of one seed
    tiers: bool = False         # run with second KV tiers
    tier_loads: int = 0         # blocks loaded back from them

    def replay(self) -> str:
        return f"python -m tests.sim.replay --seed {self.seed}" + (" --tiers" if self.tiers else "")


class Sim:
    """One run's world: the pool under test, its workers, clients and faults."""

    def __init__(self, seed: int, only: tuple[str, ...] = (), tiers: bool = False):
        self.seed = seed
        self.rng = random.Random(seed)
        rng = self.rng
        # Second KV tiers (slots a worker), from a generator of their own: a seed's run without
        # them stays the run it always was.
        self.tiers = tiers
        self.tier_rng = random.Random(seed + 7_000_003)
        self.loop = VirtualLoop()
        self.pool_name = "sim"
        self.step_timeout_s = rng.choice([0.5, 1.0])
        self.orphan_grace_s = rng.choice([1.0, 3.0, 10.0])
        self.faults = Faults.draw(rng, quiet_at=rng.uniform(3.0, 12.0), only=only)
        self.block_size = rng.choice([4, 8])
        self.max_running = rng.randint(2, 8)
        self.policy = create_policy(rng.choice(["qos", "qos", "qos", "fcfs"]), QoSSettings(
            kv_caps={HIGH: 1.0, MEDIUM: rng.choice([0.5, 0.7, 1.0]), LOW: rng.choice([0.3, 0.5])},
            tenant_fairness=rng.random() < 0.5, kv_cap_mode=rng.choice(["strict", "strict", "elastic"]),
            high_cut_in=rng.random() < 0.7, high_cut_in_slots=rng.choice([0.0, 0.25, 0.5])))
        self.prefix_caching = rng.random() < 0.5 or tiers     # a tier serves prefix caching only
        self.streaming = StreamSettings({p: "refuse" for p in ORDER},
                                        StreamWindow(self.block_size // 2, 2 * self.block_size), 16, 4000)
        self.network = Network(self)
        self.trust = FakeTrust(self.network)
        self.trace: list[tuple] = []
        self.events = 0             # things that happened to the pool from outside (invariants.py)
        self.corruptions: list[str] = []
        self.plan_errors: list[str] = []
        self.clients = []
        self.batcher: ContinuousBatcher | None = None
        self.invariants = Invariants(self)

    # --- notes from the simulated workers ---------------------------------------------------------

    def note_corruption(self, address: str, seq_id: int, why: str) -> None:
        self.corruptions.append(f"{address}: sequence {seq_id}: {why}")

    def note_plan_error(self, address: str, step_id: int, error: str) -> None:
        self.plan_errors.append(f"{address} refused step {step_id}: {error}")
        self.trace.append((round(self.loop.now, 6), "plan_error", address, error))

    def crash(self, worker: SimWorker, where: str, restart_after: float | None = None) -> None:
        """The worker process dies (its stream breaks) and comes back later, empty, at its address."""
        if not worker.alive:
            return
        worker.crash(where)
        self.trace.append((round(self.loop.now, 6), "crash", worker.address))
        delay = restart_after if restart_after is not None else self.rng.choice(
            [self.rng.uniform(0.05, 1.0), self.rng.uniform(1.0, 2 * self.orphan_grace_s)])
        self.loop.call_later(delay, self.restart, worker)

    def restart(self, worker: SimWorker) -> None:
        if not worker.alive:
            worker.start()
            self.trace.append((round(self.loop.now, 6), "restart", worker.address))

    # --- the run ------------------------------------------------------------------------------------

    def build(self) -> None:
        rng = self.rng
        cache = PrefixCache({HIGH: 0.5, MEDIUM: 0.3, LOW: 0.2}) if self.prefix_caching else None
        self.max_step_tokens = rng.choice([16, 32, 64])
        self.batcher = ContinuousBatcher(
            self.pool_name, [], self.policy, self.max_running, self.max_step_tokens,
            ResourceMonitorOrNone(self.policy), orphan_grace_s=self.orphan_grace_s,
            step_timeout_s=self.step_timeout_s, stream_max_hold_s=0.05, prefix_cache=cache,
            clock=self.loop.time)
        self.batcher.planner.stream_chunk = self.streaming.chunk_tokens
        self.admission = Admission(self.pool_name, self.policy.kv_cap, self.policy.waiting,
                                   self.batcher.estimated_wait_ms, rng.choice([8, 64]), 1000, self.streaming,
                                   self.policy.tenant_waiting if self.policy.tenant_fairness else None)
        self.pool_adapters = PoolAdapters(self.pool_name, self.batcher)
        self.drain = Drain(f"scheduler of pool {self.pool_name}")
        self.membership = Membership(
            self.batcher, lambda index, address: WorkerLink(index, address, self.trust, self.batcher.make_pool),
            resolver=self.resolve, dns_interval_s=1.0, forget_after_s=5.0)
        count = rng.randint(1, 3)
        self.workers = [SimWorker(self, f"w{i}:1", rng.choice([16, 24, 48, 96]), self.block_size,
                                  {"a1": "/a/1"} if rng.random() < 0.7 else {})
                        for i in range(count + (1 if rng.random() < 0.3 else 0))]
        for worker in self.workers:
            worker.tier_blocks = self.tier_rng.choice([0, 2, 8, 64, 256]) if self.tiers else 0
        for worker in self.workers:
            self.network.workers[worker.address] = worker
        self.dns = {w.address for w in self.workers[1:count]} if rng.random() < 0.5 else set()
        self.configured = [w.address for w in self.workers[:count] if w.address not in self.dns]
        self.late = [w.address for w in self.workers[count:]]

    async def resolve(self, host: str, port: int) -> list[str]:
        return sorted(self.dns)

    async def main(self) -> None:
        self.build()
        self.membership.start(self.configured, "workers.sim:1" if self.dns else None)
        loop_task = asyncio.ensure_future(self.batcher.run())
        self.clients = workload(self)
        for client in self.clients:
            client.task = asyncio.ensure_future(client.run())
        chaos_task = asyncio.ensure_future(chaos(self))
        advise_task = asyncio.ensure_future(self.advise())
        deadline = self.faults.quiet_at + SETTLE_S
        try:
            while not all(c.done for c in self.clients) and self.loop.now < deadline:
                await asyncio.sleep(0.25)
            await asyncio.sleep(2.0)       # heartbeats: workers drop what the scheduler released
            self.invariants.at_end()
        finally:
            chaos_task.cancel()
            advise_task.cancel()
            loop_task.cancel()
            for client in self.clients:
                client.task.cancel()
            await self.membership.stop()

    async def advise(self) -> None:
        """What SchedulerService._advise does once a second: run-time adapters onto workers that
        joined (or came back) without them."""
        while True:
            await asyncio.sleep(1.0)
            await self.pool_adapters.sync()

    def outcome(self, failure: str = "") -> Outcome:
        errors: dict[str, int] = {}
        for client in self.clients:
            end = client.ended
            key = "cancelled" if client.gone else "completed" if end is not None and not hasattr(end, "kind") \
                else f"{end.kind.value}:{end.reason}" if end is not None else "none"
            errors[key] = errors.get(key, 0) + 1
        trace = repr((self.trace, self.faults.log, sorted(errors.items()), failure,
                      self.batcher.steps if self.batcher else 0))
        cache = self.batcher.prefix_cache if self.batcher else None
        return Outcome(self.seed, not failure, failure, round(self.loop.now, 3),
                       self.batcher.steps if self.batcher else 0, len(self.clients),
                       errors.pop("completed", 0), errors, self.faults.counts(),
                       hashlib.sha256(trace.encode()).hexdigest()[:16], self.tiers,
                       sum(cache.tier_loaded.values()) if cache is not None else 0)


def ResourceMonitorOrNone(policy):
    from services.scheduler.monitor import ResourceMonitor
    return ResourceMonitor(policy) if policy.name == "qos" else None


def simulate(seed: int, only: tuple[str, ...] = (), log_level: int = logging.CRITICAL,
             tiers: bool = False) -> Outcome:
    """Run seed `seed` (only the fault kinds `only`, if given; `tiers`: workers with second KV
    tiers). Never raises for a broken invariant: the Outcome says what broke."""
    sim = Sim(seed, only, tiers)
    loop = sim.loop
    sim.loop.after_each = sim.invariants.check
    logging.disable(log_level)
    failure = ""
    try:
        with virtual_time(loop):
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(sim.main())
            except Violation as exc:
                failure = str(exc)
            except Stuck as exc:
                failure = f"stuck: {exc}"
            finally:
                loop.after_each = None
                _cancel_all(loop)
    finally:
        logging.disable(logging.NOTSET)
        asyncio.set_event_loop(None)
        loop.close()
    if not failure and sim.invariants.violations:
        failure = sim.invariants.violations[0]
    return sim.outcome(failure)


def _cancel_all(loop: VirtualLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    gathered = asyncio.gather(*tasks, return_exceptions=True)
    for _ in range(100):        # a task cancelled now may stop the loop (run_until_complete's callback)
        try:
            loop.run_until_complete(gathered)
        except (Stuck, Violation, RuntimeError):
            pass
        if gathered.done():
            return
