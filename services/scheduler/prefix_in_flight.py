"""Prefixes being computed: a request whose next block another running sequence of the same pool
is computing right now waits for it instead of computing it again.

Prefix caching names a block only once a step has filled it, so requests that share a prefix and
arrive together (a burst of one system prompt, the turns a trace sends within a second) found
nothing cached and each computed the whole prefix. Here every admitted sequence registers the
names of the full blocks it is about to compute (the first to register a name leads it). A request
at its lane's head whose longest cached prefix stops at a block some leader is computing is not
admitted this step: it stays at the head, and is admitted with that block shared once the leader
has named it (or once the leader is gone: preempted, finished, failed over, and then nothing is
led). A burst of N requests with one shared prefix computes it once.

The class rule: a request waits only behind a leader of its own class or a more urgent one. The
leader's prompt chunks then get at least the step tokens the follower's own would (running
sequences of a lane are served before its admissions, and a more urgent lane is served first), so
a follower is admitted no later than it would have finished computing the prefix itself. A High
request never waits behind a Medium or Low leader, whose prefill fair queueing may hold back: it
computes the prefix itself, at once.

Pure Python, no torch.
"""
from __future__ import annotations

from weakref import WeakKeyDictionary

from services.common.prefix_blocks import PrefixCachingPool
from services.scheduler.request import Request


class InFlightPrefixes:
    """Per pool: the names of blocks being computed -> the running request computing them."""

    def __init__(self) -> None:
        # A pool is replaced when its worker reconnects; the old one's table goes with it.
        self._tables: WeakKeyDictionary[PrefixCachingPool, dict[bytes, Request]] = WeakKeyDictionary()

    def table(self, pool: PrefixCachingPool) -> dict[bytes, Request]:
        table = self._tables.get(pool)
        if table is None:
            table = self._tables[pool] = {}
        return table

    def lead(self, pool: PrefixCachingPool, request: Request, names: list[bytes]) -> None:
        """`request` was admitted to `pool` and will compute the blocks named `names` (its full
        blocks after its cached prefix): it leads those no one else is computing."""
        table = self.table(pool)
        request.leading = [name for name in names if table.setdefault(name, request) is request]

    def named(self, pool: PrefixCachingPool, request: Request, upto: int) -> None:
        """The request named its blocks before index `upto`: those it led are cached now."""
        leading = request.leading
        if not leading:
            return
        table, names = self.table(pool), request.block_names
        done = set(names[:upto])
        kept = []
        for name in leading:
            if name in done:
                if table.get(name) is request:
                    del table[name]
            else:
                kept.append(name)
        request.leading = kept

    def gone(self, pool: PrefixCachingPool, request: Request) -> None:
        """The request left the pool (finished, preempted, moved): it leads nothing any more."""
        if request.leading:
            table = self.table(pool)
            for name in request.leading:
                if table.get(name) is request:
                    del table[name]
            request.leading = []

    def leader(self, pool: PrefixCachingPool, request: Request, name: bytes) -> Request | None:
        """The request that `request` should wait for: the one computing the block `name` (the
        block after its cached prefix) on `pool`, if it is of the same class or a more urgent one."""
        table = self._tables.get(pool)
        leader = table.get(name) if table else None
        if leader is None or leader is request or leader.priority > request.priority:
            return None     # Priority: HIGH < MEDIUM < LOW
        return leader

    def run(self, pool: PrefixCachingPool, names: list[bytes]) -> int:
        """How many of `names`, from the first, are being computed on `pool`."""
        table = self._tables.get(pool)
        count = 0
        while table and count < len(names) and names[count] in table:
            count += 1
        return count
