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

Sharing is kept within a request's cache scope (request_scope): by default its tenant, as the
router knows it (from the caller's key when auth is on), narrowed by the request's cache_salt.
The scheduler names cached blocks within the scope, so a tenant never finds, or learns by a
cached-token count, a discount or a faster first token, that another tenant sent a prefix
(vLLM's cache_salt answers the same leak); the opening's key carries the scope too, so placement
follows it. Pure Python.
"""
from __future__ import annotations

import json
from collections import OrderedDict

OPENING_CHARS = 1024
KEYS = 65_536
QUEUE_SLACK = 4


def request_scope(setting: str, tenant: str, salt: str) -> str:
    """The prefix-cache scope of a request: its tenant (setting "tenant") or none ("cluster"),
    and its salt; "" when it shares with every request. Written so that no two (tenant, salt)
    pairs give one scope."""
    parts = {**({"tenant": tenant} if setting == "tenant" else {}), **({"salt": salt} if salt else {})}
    return json.dumps(parts, separators=(",", ":")) if parts else ""


def affinity_key(prompt: str, messages=(), scope: str = "", token_ids=()) -> int:
    """A key for the request's opening within its cache scope (0: none): chat messages up to the
    first user message, or the prompt's first OPENING_CHARS characters (its first OPENING_CHARS / 4
    tokens when it comes as token ids)."""
    if token_ids:
        return hash((scope, tuple(token_ids[:OPENING_CHARS // 4]))) or 1
    if messages:
        opening = []
        for message in messages:
            opening.append((message.role, message.content))
            if message.role == "user":
                break
        return hash((scope, tuple(opening))) or 1
    return hash((scope, prompt[:OPENING_CHARS])) or 1 if prompt else 0


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
