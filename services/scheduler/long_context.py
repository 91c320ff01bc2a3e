"""Which requests streaming mode serves (services/common/stream_window.py): the request's own
`x-context-mode`, else its class's default for prompts that pass the model's context.

    dense       every token attends every earlier one; past the context: refused
    streaming   attention sinks + a recent window, any length (up to stream_max_tokens)
    auto        dense, unless prompt + max_tokens pass the context and the class's long_prompts
                is "stream" (by default Low's: batch summaries of long documents)

Pure functions over plain values; refusals name the setting or the field to change.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import ErrorKind, ServiceError
from services.common.priority import CONTEXT_MODE_HEADER, ORDER, priority_name
from services.common.proto.qos.v1 import common_pb2, worker_pb2
from services.common.stream_window import StreamWindow
from services.scheduler.request import Request


@dataclass(slots=True, frozen=True)
class StreamSettings:
    """A pool's streaming settings ([pools.scheduler] long_prompts and stream_*)."""
    long_prompts: dict[int, str]      # priority -> "refuse" or "stream"
    window: StreamWindow
    chunk_tokens: int                 # the largest prompt chunk of one step
    max_tokens: int                   # the longest prompt + max_tokens accepted

    @classmethod
    def from_config(cls, config) -> StreamSettings:
        """From a SchedulerConfig."""
        return cls(dict(zip(ORDER, config.long_prompts)),
                   StreamWindow(config.stream_sink_tokens, config.stream_window_tokens),
                   config.stream_chunk_tokens, config.stream_max_tokens)


def choose_window(context_mode: int, priority: int, prompt_len: int, sampling: common_pb2.SamplingParams,
                  max_context: int, block_size: int, settings: StreamSettings) -> StreamWindow | None:
    """The window a request is served with, or None for dense attention. A streaming request the
    pool's workers cannot serve is refused (the window does not fit their context or block)."""
    if context_mode == common_pb2.CONTEXT_MODE_DENSE:
        return None
    if context_mode != common_pb2.CONTEXT_MODE_STREAMING:
        asked = prompt_len + (sampling.max_tokens if sampling.HasField("max_tokens") else 1)
        if asked <= max_context or settings.long_prompts.get(priority) != "stream":
            return None
    window = settings.window
    try:
        window.check(max_context, block_size)
    except ValueError as exc:
        raise ServiceError(
            ErrorKind.UNSUPPORTED, f"streaming mode cannot serve the {priority_name(priority)} request: "
            f"{exc} (the pool's stream_sink_tokens / stream_window_tokens)", field=CONTEXT_MODE_HEADER,
            reason="stream_window") from None
    return window


def too_long_hint(settings: StreamSettings | None) -> str:
    """What a refused over-long dense request may do instead."""
    if settings is None:
        return ""
    return f"; or ask for streaming mode ({CONTEXT_MODE_HEADER}: streaming) to attend a recent window"


class PassedBlocks:
    """Streaming sequences' blocks that no later token reads: back to the pool after the step that
    passed them, out of the worker's block table with its next plan (StepPlan.dropped_*)."""

    def __init__(self) -> None:
        self._pending: dict[int, list[tuple[int, int]]] = {}     # worker -> (seq id, blocks)

    def after_step(self, worker, request: Request) -> None:
        dropped = request.drop_blocks(worker.pool.block_size)
        if dropped:
            worker.pool.free(request.priority, dropped)
            self._pending.setdefault(worker.index, []).append((request.seq_id, len(dropped)))

    def into(self, plan: worker_pb2.StepPlan, worker_index: int) -> None:
        for seq_id, count in self._pending.pop(worker_index, ()):
            plan.dropped_seq_ids.append(seq_id)
            plan.dropped_block_counts.append(count)

    def forget(self, worker_index: int) -> None:
        """A worker left (or restarts empty): nothing of it to drop."""
        self._pending.pop(worker_index, None)
