"""Run a list of requests to completion on one engine with continuous batching.

An offline driver for the engine (demo, benchmarks, tests), not the serving scheduler: it
reserves each request's whole KV need (prompt + max_tokens) when it admits it, so it never has to
preempt. Each step decodes every running sequence and fills the rest of the token budget with
prefill chunks, oldest first; finished sequences free their blocks and waiting ones join at once.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.step import FinishReason, SamplingParams, SequenceWork, StepBatch
from services.engine.engine import Engine
from services.common.kv_blocks import KVBlockPool, blocks_for_tokens


@dataclass(slots=True)
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    lora: str = ""                # a loaded LoRA adapter ("": the base model)


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: FinishReason
    ttft_seconds: float           # from run() start to the first token
    latency_seconds: float        # from run() start to the last token


@dataclass(slots=True)
class _Running:
    index: int
    request: GenerationRequest
    blocks: list[int]
    computed: int = 0                              # prompt tokens already in the KV cache
    output: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    constraint: object = None                      # structured output: its grammar state


class BatchRunner:
    def __init__(self, engine: Engine, max_running: int = 32, max_step_tokens: int = 512):
        if max_running < 1 or max_step_tokens < max_running:
            raise ValueError("need max_running >= 1 and max_step_tokens >= max_running")
        self.engine = engine
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.pool = KVBlockPool(engine.kv_spec.num_blocks, engine.kv_spec.block_size)

    def _blocks_needed(self, request: GenerationRequest) -> int:
        tokens = min(len(request.prompt_ids) + request.sampling.max_tokens, self.engine.max_context)
        return blocks_for_tokens(tokens, self.pool.block_size)

    def run(self, requests: list[GenerationRequest],
            on_token: Callable[[int, int], None] | None = None) -> list[GenerationResult]:
        """Generate for every request; `on_token(request_index, token_id)` streams tokens."""
        for i, request in enumerate(requests):
            if len(request.prompt_ids) >= self.engine.max_context:
                raise ValueError(f"request {i}: prompt of {len(request.prompt_ids)} tokens leaves no "
                                 f"room in the {self.engine.max_context}-token context window")
            if self._blocks_needed(request) > self.pool.num_blocks:
                raise ValueError(f"request {i} needs more KV blocks than the whole cache holds")
        started = time.perf_counter()
        waiting = deque(enumerate(requests))
        running: list[_Running] = []
        results: dict[int, GenerationResult] = {}
        while waiting or running:
            while waiting and len(running) < self.max_running:
                index, request = waiting[0]
                blocks = self.pool.allocate(index, self._blocks_needed(request))
                if blocks is None:
                    break
                waiting.popleft()
                running.append(_Running(index, request, blocks, constraint=self.engine.grammars.matcher(
                    request.sampling, []) if request.sampling.constrained else None))
            batch = self._plan_step(running)
            output = self.engine.step(batch)
            now = time.perf_counter()
            by_id = {seq.index: seq for seq in running}
            for work in batch.sequences:
                seq = by_id[work.seq_id]
                if not seq.output:  # a prefill chunk (decodes only run once there is output)
                    seq.computed = work.end
            for token in output.tokens:
                seq = by_id[token.seq_id]
                seq.output.append(token.token_id)
                seq.first_token_at = seq.first_token_at or now
                if on_token:
                    on_token(seq.index, token.token_id)
                if token.finish_reason is not None:
                    results[seq.index] = GenerationResult(seq.output, token.finish_reason,
                                                          seq.first_token_at - started, now - started)
                    self.pool.free(seq.index, seq.blocks)
            running = [seq for seq in running if seq.index not in results]
        return [results[i] for i in range(len(requests))]

    def _plan_step(self, running: list[_Running]) -> StepBatch:
        budget = self.max_step_tokens
        work: list[SequenceWork] = []
        for seq in running:
            if seq.output:  # decoding: feed back the last sampled token
                prompt_len = len(seq.request.prompt_ids)
                work.append(SequenceWork(seq.index, [seq.output[-1]], prompt_len + len(seq.output) - 1,
                                         seq.blocks, seq.request.sampling, len(seq.output),
                                         lora=seq.request.lora, constraint=seq.constraint,
                                         history=_history(seq), output_start=prompt_len))
                budget -= 1
        for seq in running:
            remaining = len(seq.request.prompt_ids) - seq.computed
            if seq.output or remaining == 0 or budget == 0:
                continue
            chunk = min(remaining, budget)
            work.append(SequenceWork(seq.index, seq.request.prompt_ids[seq.computed:seq.computed + chunk],
                                     seq.computed, seq.blocks, seq.request.sampling, 0,
                                     sample=chunk == remaining, lora=seq.request.lora, constraint=seq.constraint,
                                     history=_history(seq), output_start=len(seq.request.prompt_ids)))
            budget -= chunk
        return StepBatch(work)


def _history(seq: _Running) -> list[int]:
    """What its penalties count (SequenceWork.history): only a penalised request pays the copy."""
    return [*seq.request.prompt_ids, *seq.output] if seq.request.sampling.penalised else []
