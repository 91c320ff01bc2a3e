"""Admission control: is a tokenized request one this pool can serve, and can it serve it now?

Pure functions over plain values (no server, no tokenizer), so each refusal is unit-tested alone
(tests/unit/test_admission.py). Every refusal is a ServiceError naming the field or the limit;
limits that pass say when to retry (`retry_after_ms`), limits that never pass say what to change.

    invalid    empty prompt, prompt or max_tokens beyond the context window (streaming mode: beyond
               stream_max_tokens), bad sampling values
    too_large  prompt + max_tokens (streaming mode: its window's blocks) need more KV blocks than
               the class may ever hold (its cap)
    exhausted  the class's queue is full (retry after the configured time; with tenant fairness,
               only for a tenant holding its share of the queue: another tenant's flood does not
               lock it out), or the estimated wait for the first token already exceeds the
               request's x-slo-ms (retry after the excess)
    unavailable  no worker of the pool is connected (none has joined yet, or all have left)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

from services.common.errors import ErrorKind, ServiceError, invalid, unavailable
from services.common.kv_blocks import blocks_for_tokens, cap_blocks
from services.common.priority import ORDER, priority_name
from services.common.proto.qos.v1 import common_pb2, worker_pb2
from services.common.step import SamplingParams
from services.common.stream_window import StreamWindow
from services.common.wire import sampling_from_request
from services.scheduler.long_context import StreamSettings, too_long_hint

DEFAULT_MAX_TOKENS = 256
# A refused SLO request is told to come back when the backlog ahead of it should have shrunk
# enough; never sooner than this.
MIN_SLO_RETRY_MS = 100
NO_WORKER_RETRY_MS = 1000


@dataclass(slots=True, frozen=True)
class PoolLimits:
    """What the connected workers allow: the context window, block size, the largest cache."""
    max_context: int
    block_size: int
    largest_worker_blocks: int


def pool_limits(infos: Iterable[worker_pb2.WorkerInfo | None], pool: str) -> PoolLimits:
    """From the workers seen so far (None for one never connected); UNAVAILABLE if none."""
    seen = [i for i in infos if i is not None]
    if not seen:
        raise unavailable(f"no worker of pool {pool} is connected (none has joined yet, or all have left); "
                          "retry shortly",
                          retry_after_ms=NO_WORKER_RETRY_MS, reason="no_worker")
    largest = max(seen, key=lambda i: i.num_blocks)
    return PoolLimits(max_context=min(i.max_context for i in seen), block_size=largest.block_size,
                      largest_worker_blocks=largest.num_blocks)


def check_priority(priority: int) -> None:
    """The router always names a class; a caller of the scheduler's own RPCs might not."""
    if priority not in ORDER:
        raise invalid(f"priority must be one of {', '.join(f'{int(p)} ({priority_name(p)})' for p in ORDER)}, "
                      f"got {priority}", field="priority")


def check_prompt(prompt_ids: list[int], max_context: int, hint: str = "",
                 limit: str = "the context window") -> None:
    if not prompt_ids:
        raise invalid("prompt is empty after tokenization", field="prompt")
    if len(prompt_ids) >= max_context:
        raise invalid(f"prompt is {len(prompt_ids)} tokens; {limit} is {max_context} "
                      f"tokens and must leave room for at least one generated token{hint}", field="prompt")


def resolve_sampling(s: common_pb2.SamplingParams, prompt_len: int, max_context: int, hint: str = "",
                     limit: str = "the context window") -> SamplingParams:
    """The request's sampling with defaults applied; max_tokens defaults to what fits."""
    room = max_context - prompt_len
    if s.HasField("max_tokens"):
        if s.max_tokens > room:
            raise invalid(f"sampling.max_tokens={s.max_tokens} does not fit: the prompt is "
                          f"{prompt_len} tokens and {limit} {max_context}, leaving {room}{hint}",
                          field="sampling.max_tokens")
        max_tokens = s.max_tokens
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    try:
        return sampling_from_request(s, max_tokens)
    except ValueError as exc:      # SamplingParams names the field
        raise invalid(f"sampling.{exc}", field=f"sampling.{str(exc).split()[0]}") from exc


def check_kv_cap(priority: int, tokens: int, limits: PoolLimits, cap_share: float, pool: str,
                 need: int | None = None) -> None:
    """A request whose whole sequence (`need` blocks where given) could never fit under its
    class's cap is refused for good."""
    what = f"prompt + max_tokens = {tokens} tokens" if need is None else "its streaming window's"
    need = blocks_for_tokens(tokens, limits.block_size) if need is None else need
    cap = cap_blocks(limits.largest_worker_blocks, cap_share)
    if need > cap:
        raise ServiceError(
            ErrorKind.TOO_LARGE,
            f"the request needs {need} KV blocks ({what}) but the "
            f"{priority_name(priority)} class may hold at most {cap} ({cap_share:.0%} of the largest "
            f"worker's {limits.largest_worker_blocks} blocks of pool {pool}); lower "
            "sampling.max_tokens or shorten the prompt", field="sampling.max_tokens", reason="kv_cap")


def check_queue(priority: int, waiting: int, max_queue: int, retry_after_ms: int, pool: str,
                tenant_share: tuple[int, int] | None = None) -> None:
    """`tenant_share` (with tenant fairness): the caller's requests waiting in the class and the
    tenants waiting there counting it. A full queue then still takes a request from a tenant
    holding less than max_queue / tenants of it, up to 2 x max_queue in all (a hard bound: with
    auth off a client may name a new tenant with every request); the refusal names the caller's
    own count only (the others' are theirs)."""
    if waiting < max_queue:
        return
    if tenant_share is None or waiting >= 2 * max_queue:
        raise ServiceError(
            ErrorKind.EXHAUSTED, f"the {priority_name(priority)} queue of pool {pool} is full "
            f"({max_queue} waiting); retry after {retry_after_ms} ms",
            retry_after_ms=retry_after_ms, reason="queue_full")
    held, tenants = tenant_share
    if held * tenants < max_queue:
        return
    raise ServiceError(
        ErrorKind.EXHAUSTED, f"the {priority_name(priority)} queue of pool {pool} is full and {held} of "
        f"your requests wait in it, your share of its {max_queue} places; retry after {retry_after_ms} ms",
        retry_after_ms=retry_after_ms, reason="queue_full")


def check_slo(slo_ms: int, estimated_wait_ms: float) -> None:
    """Refuse at once what would miss its latency objective anyway. Retry when the backlog ahead
    should have shrunk by the excess (the estimate counts the queue at the class's token rate)."""
    if slo_ms and estimated_wait_ms > slo_ms:
        retry = max(MIN_SLO_RETRY_MS, math.ceil(estimated_wait_ms - slo_ms))
        raise ServiceError(
            ErrorKind.EXHAUSTED, f"estimated wait of {estimated_wait_ms:.0f} ms for the first token "
            f"exceeds x-slo-ms={slo_ms}; retry after {retry} ms", field="x-slo-ms",
            retry_after_ms=retry, reason="slo")


@dataclass(slots=True)
class Admission:
    """The checks in order, for one pool; the server supplies the live figures."""
    pool: str
    kv_cap: Callable[[int], float]                   # priority -> share of a worker's blocks
    waiting: Callable[[int], int]                    # priority -> requests queued
    estimated_wait_ms: Callable[[int, int, str, float], float]   # (priority, prompt tokens, tenant, weight) -> ms
    max_queue: int
    retry_after_ms: int
    streaming: StreamSettings | None = None
    # (priority, tenant) -> (the tenant's requests waiting, tenants waiting counting it), where
    # tenants share a class fairly (policy.tenant_waiting); None: the queue is one line.
    tenant_waiting: Callable[[int, str], tuple[int, int]] | None = None

    def check(self, priority: int, prompt_ids: list[int], sampling: common_pb2.SamplingParams,
              slo_ms: int, limits: PoolLimits, window: StreamWindow | None = None,
              tenant: str = "", tenant_weight: float = 1.0) -> SamplingParams:
        """Raises ServiceError for the first check that fails; returns the resolved sampling.
        `window`: streaming mode serves it (long_context.choose_window)."""
        check_priority(priority)
        if window is None:
            hint = too_long_hint(self.streaming)
            check_prompt(prompt_ids, limits.max_context, hint)
            resolved = resolve_sampling(sampling, len(prompt_ids), limits.max_context, hint)
            need = None
        else:
            limit = "streaming mode's limit (stream_max_tokens)"
            check_prompt(prompt_ids, self.streaming.max_tokens, limit=limit)
            resolved = resolve_sampling(sampling, len(prompt_ids), self.streaming.max_tokens, limit=limit)
            need = min(blocks_for_tokens(len(prompt_ids) + resolved.max_tokens, limits.block_size),
                       window.max_blocks(self.streaming.chunk_tokens, limits.block_size))
        check_kv_cap(priority, len(prompt_ids) + resolved.max_tokens, limits, self.kv_cap(priority),
                     self.pool, need)
        check_queue(priority, self.waiting(priority), self.max_queue, self.retry_after_ms, self.pool,
                    None if self.tenant_waiting is None else self.tenant_waiting(priority, tenant))
        check_slo(slo_ms, self.estimated_wait_ms(priority, len(prompt_ids), tenant, tenant_weight) if slo_ms else 0.0)
        return resolved
