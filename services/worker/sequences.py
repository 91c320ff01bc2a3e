"""The worker's per-sequence state, and turning a StepPlan diff into the engine's StepBatch.

Pure Python (the engine call happens in the server): each sequence keeps its tokens, how many of
them are in the KV cache, its block table and sampling parameters, so a plan only carries ids,
token counts and new block ids.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.proto.qos.v1 import worker_pb2
from services.common.step import SampledToken, SamplingParams, SequenceWork, StepBatch, guides_set
from services.common.stream_window import StreamWindow
from services.common.wire import sampling_from_engine


class PlanError(ValueError):
    """A plan inconsistent with the sequences the worker holds (a scheduler bug)."""


@dataclass(slots=True)
class SequenceState:
    tokens: list[int]             # prompt, then every sampled token
    prompt_len: int
    sampling: SamplingParams
    num_generated: int            # before this worker saw it (resumed after preemption)
    block_table: list[int] = field(default_factory=list)
    computed: int = 0             # tokens whose K/V are in the cache
    traceparent: str = ""         # the request's trace context, for step-span links
    lora: str = ""                # LoRA adapter ("": the base model)
    span_context: object = None   # traceparent parsed once, by the server, when tracing is on
    window: StreamWindow | None = None    # streaming mode (services/common/stream_window.py)
    dropped_blocks: int = 0       # blocks after the sink block let go from the table's front
    constraint: object = None     # structured output: its grammar state (services/engine/grammar.py)


class SequenceTable:
    def __init__(self, block_size: int = 16,
                 constrain: Callable[[SamplingParams, list[int]], object] | None = None) -> None:
        self.sequences: dict[int, SequenceState] = {}
        self.block_size = block_size
        # (sampling, tokens generated so far) -> the grammar state of a constrained sequence
        # (Grammars.matcher): derived from its tokens, so one announced again continues exactly.
        self.constrain = constrain

    def __len__(self) -> int:
        return len(self.sequences)

    def clear(self) -> None:
        self.sequences.clear()

    def apply(self, plan: worker_pb2.StepPlan) -> StepBatch:
        """Update state from the plan and return the engine's work. Raises PlanError, leaving the
        table unchanged, when the plan does not fit the state."""
        self._check(plan)
        sequences = self.sequences
        for seq_id, count in zip(plan.dropped_seq_ids, plan.dropped_block_counts):
            seq = sequences.get(seq_id)     # absent: it finished in the step that passed them
            if seq is not None:
                del seq.block_table[1:1 + count]
                seq.dropped_blocks += count
        for seq_id in plan.released_seq_ids:
            sequences.pop(seq_id, None)
        for new in plan.new_sequences:
            tokens = list(new.prompt_token_ids)
            sampling = sampling_from_engine(new.sampling)
            sequences[new.seq_id] = SequenceState(
                tokens=tokens, prompt_len=len(tokens),
                sampling=sampling, num_generated=new.num_generated,
                traceparent=new.traceparent, lora=new.lora, computed=new.cached_tokens,
                window=StreamWindow(new.sink_tokens, new.window_tokens) if new.window_tokens else None,
                constraint=self.constrain(sampling, tokens[len(tokens) - new.num_generated:])
                if sampling.constrained else None)
        for seq_id, block_id in zip(plan.granted_seq_ids, plan.granted_block_ids):
            sequences[seq_id].block_table.append(block_id)
        work = []
        for seq_id, num_tokens in zip(plan.scheduled_seq_ids, plan.scheduled_num_tokens):
            seq = self.sequences[seq_id]
            start = seq.computed
            end = start + num_tokens
            prompt_end = seq.prompt_len - seq.num_generated      # the client's prompt (not resumed output)
            work.append(SequenceWork(
                seq_id=seq_id, token_ids=seq.tokens[start:end], position=start,
                block_table=seq.block_table, sampling=seq.sampling,
                num_generated=seq.num_generated + len(seq.tokens) - seq.prompt_len,
                sample=end == len(seq.tokens), lora=seq.lora, window=seq.window,
                dropped_blocks=seq.dropped_blocks, constraint=seq.constraint,
                history=seq.tokens, output_start=prompt_end,
                prompt_targets=seq.tokens[start + 1:min(end + 1, prompt_end)]
                if seq.sampling.prompt_logprobs is not None and start + 1 < prompt_end else ()))
        return StepBatch(work)

    def _check(self, plan: worker_pb2.StepPlan) -> None:
        released = set(plan.released_seq_ids)
        known = set(self.sequences) - released
        granted = Counter(plan.granted_seq_ids)
        for new in plan.new_sequences:
            if new.seq_id in known:
                raise PlanError(f"sequence {new.seq_id} announced twice")
            if not new.prompt_token_ids:
                raise PlanError(f"sequence {new.seq_id} has an empty prompt")
            if guides_set(new.sampling) and self.constrain is None:
                raise PlanError(f"sequence {new.seq_id} has a structured output; this worker has no grammar engine")
            if new.cached_tokens >= len(new.prompt_token_ids):
                raise PlanError(f"sequence {new.seq_id}: {new.cached_tokens} cached tokens of "
                                f"{len(new.prompt_token_ids)}; at least one must be computed")
            if new.cached_tokens > granted[new.seq_id] * self.block_size:
                raise PlanError(f"sequence {new.seq_id}: {new.cached_tokens} cached tokens but "
                                f"{granted[new.seq_id]} blocks granted")
            known.add(new.seq_id)
        if len(plan.scheduled_seq_ids) != len(plan.scheduled_num_tokens):
            raise PlanError("scheduled_seq_ids and scheduled_num_tokens differ in length")
        if len(set(plan.scheduled_seq_ids)) != len(plan.scheduled_seq_ids):
            raise PlanError("a sequence is scheduled twice in one step")
        if len(plan.granted_seq_ids) != len(plan.granted_block_ids):
            raise PlanError("granted_seq_ids and granted_block_ids differ in length")
        if len(plan.dropped_seq_ids) != len(plan.dropped_block_counts):
            raise PlanError("dropped_seq_ids and dropped_block_counts differ in length")
        for seq_id, count in zip(plan.dropped_seq_ids, plan.dropped_block_counts):
            seq = self.sequences.get(seq_id)
            if seq is not None and (seq.window is None or count >= len(seq.block_table)):
                raise PlanError(f"sequence {seq_id}: {count} blocks dropped, but it "
                                + ("is not in streaming mode" if seq.window is None else
                                   f"holds {len(seq.block_table)} (its sink block stays)"))
        for seq_id in set(plan.granted_seq_ids):
            if seq_id not in known:
                raise PlanError(f"blocks granted to sequence {seq_id}, unknown to this worker")
        lengths = {n.seq_id: len(n.prompt_token_ids) for n in plan.new_sequences}
        cached = {n.seq_id: n.cached_tokens for n in plan.new_sequences}
        for seq_id, num_tokens in zip(plan.scheduled_seq_ids, plan.scheduled_num_tokens):
            if seq_id not in known:
                raise PlanError(f"sequence {seq_id} is not known to this worker")
            seq = self.sequences.get(seq_id) if seq_id not in lengths else None
            total = lengths.get(seq_id, len(seq.tokens) if seq else 0)
            computed = seq.computed if seq else cached.get(seq_id, 0)
            if num_tokens < 1 or computed + num_tokens > total:
                raise PlanError(f"sequence {seq_id}: {num_tokens} tokens scheduled but "
                                f"{total - computed} are ready to compute")

    def commit(self, batch: StepBatch, tokens: list[SampledToken]) -> None:
        """After a successful step: advance computed counts, append sampled tokens, drop the
        sequences that finished."""
        for work in batch.sequences:
            self.sequences[work.seq_id].computed = work.end
        for token in tokens:
            seq = self.sequences[token.seq_id]
            seq.tokens.append(token.token_id)
            if token.finish_reason is not None:
                del self.sequences[token.seq_id]
