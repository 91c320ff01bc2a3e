"""A request as the scheduler tracks it. Its client stream is fed through `events`: GenerateChunk
messages, then either a final chunk (finish_reason set) or a ServiceError saying why it failed."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum

from services.common.step import SamplingParams
from services.scheduler.detokenizer import IncrementalDetokenizer


class Phase(Enum):
    WAITING = "waiting"     # queued, holds no blocks
    RUNNING = "running"     # admitted to a worker, holds blocks
    FINISHED = "finished"   # completed, cancelled or failed; holds nothing


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    seq_id: int
    priority: int
    tenant: str
    prompt_ids: list[int]
    sampling: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival: float = field(default_factory=time.perf_counter)
    arrival_ns: int = field(default_factory=time.time_ns)      # wall clock, for span timestamps
    traceparent: str = ""            # W3C context of the request's scheduler span (or "")
    lora: str = ""                   # LoRA adapter the worker adds ("": the base model)
    finished_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    worker: int | None = None        # index of the worker it runs on
    blocks: list[int] = field(default_factory=list)
    # The worker's view: tokens it was given as the prompt when announced (the prompt, or after a
    # preemption the prompt plus output so far) and how many of all tokens are in its KV cache.
    announced: bool = False
    computed: int = 0
    new_blocks: list[int] = field(default_factory=list)   # allocated, not yet sent to the worker
    cancelled: bool = False
    preemptions: int = 0
    # (perf_counter time, why, worker address) each time its worker failed or left mid-sequence
    failovers: list[tuple[float, str, str]] = field(default_factory=list)
    resumed: int = 0                 # output tokens another pool streamed before this one took over
    tenant_weight: float = 1.0       # the tenant's share inside its class
    slo_ms: float | None = None
    first_scheduled_at: float | None = None
    first_token_at: float | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens known but not yet in the KV cache: the rest of the prompt, or the last sampled
        token (or, after a preemption, everything again)."""
        return len(self.prompt_ids) + len(self.output_ids) - self.computed

    def wall_ns(self, moment: float) -> int:
        """A perf_counter moment as wall-clock nanoseconds (span timestamps)."""
        return self.arrival_ns + int((moment - self.arrival) * 1e9)

    def ms_since_arrival(self, moment: float | None) -> float:
        return 0.0 if moment is None else (moment - self.arrival) * 1000
