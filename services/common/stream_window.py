"""StreamingLLM attention (Xiao et al., ICLR 2024): which tokens a sequence in streaming mode
attends to, where they sit in its kept cache, and which KV blocks it may let go.

A streaming sequence attends, from the token at text position t, to the first `sink_tokens` of
its text (the attention sinks) and to the `window_tokens` most recent ones, t itself included:
keys at positions p < sink_tokens or t - window_tokens < p <= t. Positions are those of the kept
cache, not of the text: the sinks sit at 0 .. sink_tokens-1, the window right after them, so the
query is at cache position min(t, sink_tokens + window_tokens - 1) and no relative distance
exceeds what the model was trained on. The rule depends on t alone, never on how a prompt was cut
into chunks: recomputing a sequence (preemption, failover) gives the same tokens.

KV blocks (pure Python; the scheduler and the worker share the arithmetic, the engine checks it):
block 0 is the sink block, kept for the sequence's life (it holds the sinks; its other slots are
attended only while in the window). The other blocks hold text blocks 1, 2, ... in order; once
every token of one is older than the next query's window it is dropped from the front of the
block table. `dropped` counts those: text block b >= 1 sits at block_table[b - dropped].
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SINK_TOKENS = 4
DEFAULT_WINDOW_TOKENS = 2048


@dataclass(slots=True, frozen=True)
class StreamWindow:
    sink_tokens: int
    window_tokens: int

    def __post_init__(self) -> None:
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {self.window_tokens}")

    @property
    def cache_tokens(self) -> int:
        """Tokens one query attends to at most (its cache positions are below this)."""
        return self.sink_tokens + self.window_tokens

    def cache_position(self, position: int) -> int:
        """Where the token at text `position` sits in the cache it attends over."""
        return min(position, self.cache_tokens - 1)

    def first_kept_block(self, position: int, block_size: int) -> int:
        """The first text block after the sink block that a query at `position` (or later) reads."""
        return max(1, (position - self.window_tokens + 1) // block_size)

    def droppable(self, computed: int, dropped: int, block_size: int) -> int:
        """Blocks after the sink block that no query from position `computed` on will read, beyond
        the `dropped` already let go."""
        return max(0, self.first_kept_block(computed, block_size) - 1 - dropped)

    def max_blocks(self, chunk: int, block_size: int) -> int:
        """The most blocks the sequence holds while computing up to `chunk` tokens at once: the
        sink block and those covering the chunk and the window before its first token (W + C - 1
        tokens, at any alignment)."""
        span = self.window_tokens + chunk - 1
        return 1 + (span + block_size - 2) // block_size + 1

    def check(self, max_context: int, block_size: int) -> None:
        """Raises ValueError where the model or the cache cannot serve this window."""
        if self.sink_tokens > block_size:
            raise ValueError(f"sink_tokens={self.sink_tokens} must fit the first KV block "
                             f"({block_size} tokens)")
        if self.cache_tokens > max_context:
            raise ValueError(f"sink_tokens + window_tokens = {self.cache_tokens} exceeds the model's "
                             f"context window of {max_context} tokens")


def table_index(position: int, dropped: int, block_size: int) -> int:
    """The block table entry holding text `position` of a sequence that dropped `dropped` blocks."""
    block = position // block_size
    return block - dropped if block else 0


def kept_blocks(end: int, dropped: int, block_size: int) -> int:
    """Block table entries covering positions up to `end` - 1 (the sink block included)."""
    return table_index(end - 1, dropped, block_size) + 1
