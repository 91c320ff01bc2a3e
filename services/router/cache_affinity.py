"""Pool choice that keeps a conversation where its KV is cached.

Prefix caching lives in each pool (services/scheduler/prefix_cache.py): the next turn of a
conversation, or another call with the same long system prompt, is cheap only on the pool that
computed the first. The router does not tokenize, so it keys a request by its opening text: for
chat, the system message(s) and the first user message (what every turn of a conversation resends
unchanged); for a plain prompt, its first OPENING_CHARS characters. It remembers the pool each key
went to last (the most recent KEYS keys), and the routing rules prefer that pool wherever they
would accept it: an overflow pool that still has room by the rules, or, among several GPU pools,
one at most QUEUE_SLACK requests more queued than the least queued (services/router/routing.py);
in slo-cost, within a price, the pool predicted to meet the SLO (services/router/slo_cost.py).
Pure Python.
"""
from __future__ import annotations

from collections import OrderedDict

OPENING_CHARS = 1024
KEYS = 65_536
QUEUE_SLACK = 4


def affinity_key(prompt: str, messages=()) -> int:
    """A key for the request's opening (0: none): chat messages up to the first user message, or
    the prompt's first OPENING_CHARS characters."""
    if messages:
        opening = []
        for message in messages:
            opening.append((message.role, message.content))
            if message.role == "user":
                break
        return hash(tuple(opening)) or 1
    return hash(prompt[:OPENING_CHARS]) or 1 if prompt else 0


class CacheAffinity:
    """The pool each opening went to last, the most recent KEYS of them."""

    def __init__(self, keys: int = KEYS):
        self.keys = keys
        self._pool_of: OrderedDict[int, str] = OrderedDict()

    def remember(self, key: int, pool: str) -> None:
        if not key:
            return
        self._pool_of[key] = pool
        self._pool_of.move_to_end(key)
        if len(self._pool_of) > self.keys:
            self._pool_of.popitem(last=False)

    def pool(self, key: int) -> str | None:
        return self._pool_of.get(key) if key else None
