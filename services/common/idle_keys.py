"""Forgetting what was not seen for a while: per tenant state (the router's limits and tallies,
the scheduler's fair queues) is kept for the tenants seen lately, not for every tenant name ever
sent. With auth off any x-tenant is a tenant, so a state kept forever would grow with every name.

`IdleKeys` keeps keys by when they were last seen, oldest first: `see` is O(1), and `idle` walks
only the keys it forgets (or finds busy and sees again), never the whole set. A dict does not
give memory back when keys leave it, so after a burst the owner copies its dicts once they hold
a quarter of their peak (`compact`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

COMPACT_ABOVE = 1024       # peaks below this are not worth a copy


class IdleKeys:
    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self._seen: OrderedDict[Hashable, float] = OrderedDict()
        self._peak = 0

    def __len__(self) -> int:
        return len(self._seen)

    def see(self, key: Hashable, now: float) -> None:
        seen = self._seen
        seen[key] = now
        seen.move_to_end(key)
        if len(seen) > self._peak:
            self._peak = len(seen)

    def idle(self, now: float, busy: Callable[[Hashable], bool] | None = None,
             keep: int | None = None) -> list:
        """Forget and return the keys not seen for idle_s (and, with `keep`, the least recently
        seen beyond that many). A key `busy` says is still in use is seen now instead."""
        seen, oldest, gone = self._seen, now - self.idle_s, []
        for _ in range(len(seen)):
            key, at = next(iter(seen.items()))
            if at > oldest and (keep is None or len(seen) <= keep):
                break
            if busy is not None and busy(key):
                seen[key] = now
                seen.move_to_end(key)
            else:
                del seen[key]
                gone.append(key)
        return gone

    def compact(self) -> bool:
        """True (once) when the owner should copy its dicts: down to a quarter of a large peak.
        Copies its own."""
        if self._peak < COMPACT_ABOVE or len(self._seen) * 4 > self._peak:
            return False
        self._seen = OrderedDict(self._seen)
        self._peak = len(self._seen)
        return True
