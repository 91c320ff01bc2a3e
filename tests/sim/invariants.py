"""What must hold after every event of a run (the event loop calls `Invariants.check` after each of
its iterations), and at its end.

    streams     every chunk's tokens continue the client's stream with the next tokens of the
                request's fault-free output, and its text the fault-free text: no gap, no repeated
                token, nothing after the stream's end or after the client went away
                (Client.on_event, at the moment the scheduler puts it on the stream)
    ends        every request ends exactly once: completed with its whole fault-free text, or an
                error a client can act on (ACTIONABLE); never INTERNAL
    blocks      on every connected worker, each block the pool counts as held is held by exactly
                the running sequences that list it (shared prefix blocks: once per holder), none
                twice, none leaked; a running sequence's blocks belong to its worker's pool of now
                (not one from before the worker reconnected)
    caps        no class holds more of a pool than its cap (strict caps); running sequences per
                worker within max_running plus the cut-in slots; no plan over the step's token
                budget (worker.py, as each plan arrives)
    phases      a waiting request is queued, a running one on its worker's list, a finished one
                in neither
    stranded    no request stays running on a worker that is gone (link down, or a new pool)
                for longer than the step timeout
    corruption  no simulated worker read K/V another sequence wrote
"""
from __future__ import annotations

from services.common.errors import ErrorKind
from services.common.kv_blocks import KVBlockPool, cap_blocks
from services.scheduler.request import Phase

# Errors a client can act on, by kind -> the reasons that may come with it.
ACTIONABLE = {
    ErrorKind.UNAVAILABLE: {"no_worker", "draining"},
    ErrorKind.EXHAUSTED: {"queue_full", "slo"},
    ErrorKind.TOO_LARGE: {"kv_cap"},
    ErrorKind.UNSUPPORTED: {"unknown_adapter", "stream_window"},
    ErrorKind.INVALID: None,            # refused at admission, naming the field
}


class Violation(AssertionError):
    pass


class Invariants:
    def __init__(self, sim):
        self.sim = sim
        self.gone_since: dict[tuple, float] = {}   # (seq id, worker) -> when that worker was first seen gone
        self.pool_of: dict[tuple, object] = {}     # (seq id, worker) -> the pool it runs in
        self.violations: list[str] = []
        self.signature = None

    def fail(self, message: str) -> None:
        message = f"t={self.sim.loop.now:.4f} {message}"
        self.violations.append(message)
        raise Violation(message)

    def check(self) -> None:
        if self.violations:       # one raised inside a task the loop caught: stop the run
            raise Violation(self.violations[0])
        sim = self.sim
        batcher = sim.batcher
        if batcher is None:
            return
        now = sim.loop.now
        policy, planner = batcher.policy, batcher.planner
        # Nothing the checks read changed since the last iteration: only the clock moved (whatever
        # moves a block changes a pool's free count, a running list, or a counter here).
        signature = (batcher.steps, batcher.finished, planner.admitted.total(), len(policy), len(batcher.cancelled),
                     sim.events, tuple((l.index, l.is_connected, id(l.pool), l.pool.num_free if l.pool else -1,
                                        len(planner.running.get(l.index, ()))) for l in batcher.links))
        if signature == self.signature:
            for key, since in self.gone_since.items():
                if now - since > sim.step_timeout_s + 0.01:
                    break
            else:
                return
        self.signature = signature
        links = {link.index: link for link in batcher.links}
        queued = {id(r) for lane in policy.lanes for r in policy.queue(lane)}
        running_ids = set()
        for index, running in planner.running.items():
            link = links.get(index)
            pool = link.pool if link is not None else None
            held: dict[int, dict] = {}
            for request in running:
                if request.phase is not Phase.RUNNING or request.worker != index:
                    self.fail(f"{request.request_id} is on worker {index}'s list as {request.phase.value} "
                              f"on worker {request.worker}")
                if id(request) in running_ids or id(request) in queued:
                    self.fail(f"{request.request_id} is running twice, or running and queued")
                running_ids.add(id(request))
                if len(set(request.blocks)) != len(request.blocks):
                    self.fail(f"{request.request_id} lists a block twice: {request.blocks}")
                self._follow(request, link, pool, now)
                for block in request.blocks:
                    owners = held.setdefault(block, {})
                    owners[request.priority] = owners.get(request.priority, 0) + 1
            if pool is not None and link.is_connected:
                if isinstance(pool, KVBlockPool) and any(len(o) > 1 or sum(o.values()) > 1 for o in held.values()):
                    self.fail(f"worker {index}: a block is held by two sequences: "
                              f"{sorted(b for b, o in held.items() if sum(o.values()) > 1)[:5]}")
                self._pool_matches(index, pool, held)
                self._caps(index, pool, len(running))
        running_keys = {(r.seq_id, r.worker) for rs in planner.running.values() for r in rs}
        for key in [k for k in self.pool_of if k not in running_keys]:
            del self.pool_of[key]
        for key in [k for k in self.gone_since if k not in running_keys]:
            del self.gone_since[key]
        for client in sim.clients:
            request = client.request
            if request is None:
                continue
            if request.phase is Phase.WAITING and not request.cancelled and id(request) not in queued:
                self.fail(f"{request.request_id} is waiting but in no queue")
            if request.phase is Phase.FINISHED and (id(request) in queued or id(request) in running_ids):
                self.fail(f"{request.request_id} finished but still queued or running")
            if request.phase is Phase.RUNNING and id(request) not in running_ids:
                self.fail(f"{request.request_id} is running but on no worker's list")
        if sim.corruptions:
            self.fail(f"K/V corrupted: {sim.corruptions[0]}")

    def _follow(self, request, link, pool, now: float) -> None:
        """A running request's worker must be there, with the pool its blocks came from."""
        key = (request.seq_id, request.worker)
        first = self.pool_of.get(key)
        if first is None:
            self.pool_of[key] = first = pool
        if pool is not None and first is not None and first is not pool:
            self.fail(f"{request.request_id} still runs on worker {request.worker} after it reconnected "
                      f"(its blocks are from the pool before)")
        if pool is None or link is None or not link.is_connected:
            since = self.gone_since.setdefault(key, now)
            if now - since > self.sim.step_timeout_s + 0.01:
                self.fail(f"{request.request_id} stranded: running on worker {request.worker}, which is "
                          f"gone, for {now - since:.3f} s (step timeout {self.sim.step_timeout_s} s)")
        else:
            self.gone_since.pop(key, None)

    def _pool_matches(self, index: int, pool, held: dict[int, dict]) -> None:
        owners = pool.owners()
        if owners != held:
            leaked = sorted(set(owners) - set(held))[:5]
            free = sorted(set(held) - set(owners))[:5]
            wrong = sorted(b for b in set(owners) & set(held) if owners[b] != held[b])[:5]
            self.fail(f"worker {index}'s pool and its sequences disagree: leaked {leaked}, held but free "
                      f"{free}, held by others than the pool says {wrong}")

    def _caps(self, index: int, pool, running: int) -> None:
        sim = self.sim
        if running > sim.max_running + sim.batcher.planner.cut_in_slots:
            self.fail(f"worker {index} runs {running} sequences (max_running {sim.max_running})")
        if sim.policy.name != "qos" or sim.policy.elastic_caps:
            return
        for priority, blocks in pool.holdings().items():
            cap = cap_blocks(pool.num_blocks, sim.policy.kv_cap(priority))
            if blocks > cap:
                self.fail(f"worker {index}: class {priority} holds {blocks} blocks, its cap is {cap}")

    def pool_state(self) -> str:
        batcher = self.sim.batcher
        links = [f"{l.address} {'up' if l.is_connected else 'down'}"
                 f"{' draining' if l.index in batcher.workers.draining else ''}"
                 f"{f' {l.pool.num_free}/{l.pool.num_blocks} free' if l.pool else ''}"
                 f" running {len(batcher.running.get(l.index, ()))} adapters {sorted(l.adapters)}"
                 for l in batcher.links]
        queued = [(r.request_id, r.priority, r.num_tokens, r.lora) for lane in batcher.policy.lanes
                  for r in batcher.policy.queue(lane)]
        return f"{'; '.join(links)}; queued {queued}; held adapters {sorted(batcher.planner.held_adapters)}"

    def at_end(self) -> None:
        """Faults stopped and every client is done: nothing is left anywhere."""
        sim = self.sim
        batcher = sim.batcher
        for client in sim.clients:
            if not client.done:
                self.fail(f"{client.name} never ended ({client.describe()}); pool: {self.pool_state()}")
        if len(batcher.policy):
            self.fail(f"{len(batcher.policy)} request(s) still queued after every client ended")
        for index, running in batcher.planner.running.items():
            if running:
                self.fail(f"worker {index} still runs {[r.request_id for r in running]} after every client ended")
        for link in batcher.links:
            pool = link.pool
            if pool is None:
                continue
            leaked = pool._owner_of if isinstance(pool, KVBlockPool) else pool._holders
            if leaked:
                self.fail(f"worker {link.index} still holds blocks {sorted(leaked)[:8]} after every client ended")
