"""A request as the scheduler tracks it. Its client stream is fed through `events`: GenerateChunk
messages, then either a final chunk (finish_reason set) or a ServiceError saying why it failed."""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from services.common.errors import invalid
from services.common.step import SamplingParams
from services.common.stream_window import StreamWindow
from services.scheduler.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from collections import deque

    from services.common.kv_blocks import KVBlockPool
    from services.common.prefix_blocks import PrefixCachingPool
    from services.common.proto.qos.v1.worker_pb2 import NewSequence


class Phase(Enum):
    WAITING = "waiting"     # queued, holds no blocks
    RUNNING = "running"     # admitted to a worker, holds blocks
    FINISHED = "finished"   # completed, cancelled or failed; holds nothing


@dataclass(slots=True, eq=False, kw_only=True)
class Request:
    # What planning reads of every running sequence every step comes first, side by side: the
    # slots are laid out in this order, so a plan touches a cache line or two per sequence rather
    # than one per field (on a busy pool, most of a plan's time is waiting on memory). `pending`
    # and `room` are kept as numbers beside the counts they derive from because for a decoding
    # sequence they are small (1, and 0-15 with 16-token blocks): Python shares one object for
    # each small int, always in cache, where `computed` or `capacity` is an int object of its
    # own somewhere on the heap, one more cache miss per sequence and step.
    pending: int = field(init=False, default=0)     # num_tokens - computed
    room: int = field(init=False, default=0)        # capacity - computed: free places in its blocks
    announced: bool = False          # the worker was told of it (prompt, or all tokens again after a preemption)
    priority: int
    tenant: str
    phase: Phase = Phase.WAITING
    seq_id: int
    # Tokens in the worker's KV cache, tokens known (prompt + output) and tokens its blocks hold.
    # Change them only through advance(), add_output(), add_blocks(), set_output() and
    # reset_cache(), which keep `pending` and `room` in step.
    computed: int = 0
    num_tokens: int = field(init=False, default=0)
    capacity: int = 0                # len(blocks) x the pool's block size
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival: float = field(default_factory=time.perf_counter)
    arrival_ns: int = field(default_factory=time.time_ns)      # wall clock, for span timestamps
    traceparent: str = ""            # W3C context of the request's scheduler span (or "")
    lora: str = ""                   # LoRA adapter the worker adds ("": the base model)
    finished_at: float | None = None
    output_ids: list[int] = field(default_factory=list)     # grows by add_output() only
    worker: int | None = None        # index of the worker it runs on
    pool: KVBlockPool | PrefixCachingPool | None = None   # that worker's block pool its blocks came from
    blocks: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)   # allocated, not yet sent to the worker
    cancelled: bool = False
    preemptions: int = 0
    # (perf_counter time, why, worker address) each time its worker failed or left mid-sequence
    failovers: list[tuple[float, str, str]] = field(default_factory=list)
    resumed: int = 0                 # output tokens another pool streamed before this one took over
    # With sampling.logprobs: each recorded token's logprobs (its step's answer) until its chunk takes them
    logprobs: deque | None = None
    # With sampling.prompt_logprobs, until its first chunk takes them: its prompt tokens' entries
    # by position, as its prefill steps' answers bring them (logprobs.record_prompt)
    prompt_logprobs: dict | None = None
    chunked: int = 0                 # output tokens made into chunks here (output.token_chunk)
    return_prompt_ids: bool = False  # sampling.return_token_ids: the first chunk carries prompt_ids
    tenant_weight: float = 1.0       # the tenant's share inside its class
    slo_ms: float | None = None
    stream_interval: int = 1         # tokens per chunk after the first (output.HeldChunks)
    first_scheduled_at: float | None = None
    first_token_at: float | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # What a worker is told of it on admission, prompt part, converted once (announcement.py)
    prompt_announcement: NewSequence | None = None
    # Prefix caching (prefix_cache.py): the scope the router put it in (only requests of one scope
    # share blocks), the names of its full blocks so far (and the scope and adapter key they were
    # made under), the tokens its worker computed from cache at its first admission (usage), and
    # when its next block fills up (its `computed` count then), to be named.
    cache_scope: str = ""
    block_names: list[bytes] = field(default_factory=list)
    names_key: str = ""
    cached_tokens: int = 0
    next_name_at: int = 1 << 62      # never, while no cache names its blocks
    leading: list[bytes] = field(default_factory=list)  # names of blocks it computes that others await
    waited_for_prefix: bool = False  # it once stayed queued for a leader's blocks (prefix_in_flight.py)
    placement: tuple[int, int | None] | None = None   # (step, the worker it should go to or None: any)
    unservable_since: float | None = None   # at its lane's head, no worker could take it (failover.py)
    # Streaming mode (services/common/stream_window.py): the window it attends, and how many text
    # blocks after its sink block it let go (they count in `capacity`, no longer in `blocks`).
    window: StreamWindow | None = None
    dropped_blocks: int = 0

    def __post_init__(self) -> None:
        # One str object per tenant, shared by all its requests: a plan counts tokens by tenant
        # for every running sequence, and a shared name is found in those dicts by identity with
        # its hash in cache, where a name of each request's own (as decoded from each message) is
        # one more object to fetch from memory per sequence and step.
        self.tenant = sys.intern(self.tenant)
        self.num_tokens = len(self.prompt_ids) + len(self.output_ids)
        self.pending = self.num_tokens - self.computed
        self.room = self.capacity - self.computed

    def add_output(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.num_tokens += 1
        self.pending += 1

    def advance(self, tokens: int) -> None:
        """The worker computed `tokens` more of its tokens (a step's answer)."""
        self.computed += tokens
        self.pending -= tokens
        self.room -= tokens

    def add_blocks(self, blocks: list[int] | tuple[int, ...], block_size: int) -> None:
        """KV blocks granted to it, `capacity` kept in step."""
        self.blocks.extend(blocks)
        self.capacity = (len(self.blocks) + self.dropped_blocks) * block_size
        self.room = self.capacity - self.computed

    def reset_cache(self) -> None:
        """Nothing of it in a worker's KV cache any more, and no blocks (admitted anew, released,
        preempted): every known token is pending again."""
        self.blocks, self.new_blocks = [], []
        self.computed = self.capacity = self.room = self.dropped_blocks = 0
        self.pending = self.num_tokens
        self.next_name_at = 1 << 62

    def start_cached(self, blocks: list[int], block_size: int) -> None:
        """Just admitted with `blocks` already holding its first tokens' K/V (prefix caching):
        they are its first blocks, sent to the worker with the admission, and computed."""
        self.blocks, self.new_blocks = list(blocks), list(blocks)
        self.computed = self.capacity = len(blocks) * block_size
        self.room = 0
        self.pending = self.num_tokens - self.computed

    def drop_blocks(self, block_size: int) -> list[int]:
        """Streaming mode, after a step: the blocks after its sink block that no later token reads,
        taken off its list (capacity unchanged: they still count as passed)."""
        count = self.window.droppable(self.computed, self.dropped_blocks, block_size)
        dropped = self.blocks[1:1 + count]
        del self.blocks[1:1 + count]
        self.dropped_blocks += count
        return dropped

    def token_ids(self, start: int, end: int) -> list[int]:
        """Its known tokens [start, end): prompt, then output."""
        prompt = self.prompt_ids
        if end <= len(prompt):
            return prompt[start:end]
        output = self.output_ids
        if start >= len(prompt):
            return output[start - len(prompt):end - len(prompt)]
        return prompt[start:] + output[:end - len(prompt)]

    def set_output(self, token_ids: list[int]) -> None:
        """Output so far, as another pool streamed it (a resumed request)."""
        self.output_ids = token_ids
        self.num_tokens = len(self.prompt_ids) + len(token_ids)
        self.pending = self.num_tokens - self.computed

    def wall_ns(self, moment: float) -> int:
        """A perf_counter moment as wall-clock nanoseconds (span timestamps)."""
        return self.arrival_ns + int((moment - self.arrival) * 1e9)

    def ms_since_arrival(self, moment: float | None) -> float:
        return 0.0 if moment is None else (moment - self.arrival) * 1000


def check_token_ids(ids, vocab_size: int, field: str, keyed: bool = False) -> None:
    """Each of a request's token ids (stop ids, tokens it already streamed, the keys of its logit
    bias: `keyed`, named by id rather than index) one the model has: an id past its vocabulary
    would never be sampled, and a stop id there would never stop anything."""
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            where = f"{field}[{token_id}]" if keyed else f"{field}[{i}]={token_id}"
            raise invalid(f"{where} is not a token id of this model (its vocabulary: 0 to {vocab_size - 1})",
                          field=f"{field}[{token_id if keyed else i}]")


def resume(request: Request, streamed: list[int], vocab_size: int) -> None:
    """A request migrated from another pool: continue after the tokens it already streamed. They
    become output so far (recomputed with the prompt, counted toward max_tokens and the seeded
    random stream), and the detokenizer reads them without emitting their text again, so what
    follows is exactly what the first pool would have streamed."""
    if len(streamed) >= request.sampling.max_tokens:
        raise invalid(f"resume_token_ids holds {len(streamed)} tokens, max_tokens is "
                      f"{request.sampling.max_tokens}: nothing left to generate", field="resume_token_ids")
    check_token_ids(streamed, vocab_size, "resume_token_ids")
    for token_id in streamed:
        request.detokenizer.add(token_id)
    request.set_output(streamed)
    request.resumed = len(streamed)
