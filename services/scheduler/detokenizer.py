"""Incremental detokenization for streaming: token ids in, text deltas out, stop strings cut.

One `IncrementalDetokenizer` per request. The scheduler calls `add(token_id)` for every sampled
token and streams the returned delta, checks `stopped` to end the request on a stop string, and
calls `flush()` once generation ends to emit whatever was held back.

Why not decode each token on its own: byte-level BPE splits multi-byte characters (emoji, CJK)
across tokens, and a lone piece decodes to U+FFFD; SentencePiece-style decoders drop the leading
space of the first token they see. So, as vLLM and TGI do, we decode a short window of tokens
twice — with and without the newest tokens — and stream the difference, holding text back while
it still ends in an incomplete character. The window only spans the last emitted chunk plus what
is held, so each `add` decodes a few tokens, never the whole sequence.

Pure Python on top of the `tokenizers` library: the scheduler must never import torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as context before the first generated token: enough for decoders whose
# output for a token depends on its neighbours (leading-space stripping, byte fallback).
PROMPT_CONTEXT_TOKENS = 5

# A UTF-8 character is at most 4 bytes, so a real character completes within 4 byte-level tokens
# (a few more with tokens that start a new character after finishing one). If more tokens than
# this are held, the model is producing invalid bytes (e.g. a loop of a token ending in a lead
# byte); emit them as U+FFFD rather than let the window, and the work per token, grow forever.
MAX_HELD_TOKENS = 8


class Decoder(Protocol):
    """`tokenizers.Tokenizer` and `services.common.tokenizer.TextTokenizer` both fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True, eq=False)
class IncrementalDetokenizer:
    tokenizer: Decoder = field(repr=False)
    prompt_ids: InitVar[Sequence[int]] = ()
    skip_special_tokens: bool = True
    stop: Sequence[str] | None = None
    # Stop strings count only once this many tokens were added (a request's min_tokens): the
    # text before is emitted as it comes and the matching starts after it.
    min_tokens: int = 0
    # The stop string that ends the output is streamed too (vLLM's include_stop_str_in_output);
    # by default it is cut off with what follows it.
    include_stop: bool = False

    # The stop string that ended the output, or None.
    stop_string: str | None = field(default=None, init=False)
    # Only the decode window is kept: tokens before `_prefix_offset` are dropped as it moves, so
    # memory as well as decode work stays bounded for long generations.
    _tokens: list[int] = field(default_factory=list, init=False, repr=False)
    # Tokens [_prefix_offset:_read_offset] are context whose text is already accounted for;
    # tokens from _read_offset on have not been turned into emitted text yet.
    _prefix_offset: int = field(default=0, init=False, repr=False)
    _read_offset: int = field(default=0, init=False, repr=False)
    # Cached decode of tokens[_prefix_offset:_read_offset]; None when the window moved.
    _prefix_text: str | None = field(default=None, init=False, repr=False)
    _stops: tuple[str, ...] = field(default=(), init=False, repr=False)
    # Per stop string: its KMP failure function, and how many of its first characters the text
    # so far ends with (never all of them: that is a stop).
    _failures: tuple[tuple[int, ...], ...] = field(default=(), init=False, repr=False)
    _matched: list[int] = field(default_factory=list, init=False, repr=False)
    # Decoded text not yet emitted because it could be the start of a stop string.
    _pending: str = field(default="", init=False, repr=False)
    _emitted: list[str] = field(default_factory=list, init=False, repr=False)
    _flushed: bool = field(default=False, init=False, repr=False)
    _added: int = field(default=0, init=False, repr=False)

    def __post_init__(self, prompt_ids: Sequence[int]) -> None:
        # An empty stop string would match before the first character; ignore it (as vLLM does).
        self._stops = tuple(dict.fromkeys(s for s in (self.stop or ()) if s))
        self._failures = tuple(_failure(s) for s in self._stops)
        self._matched = [0] * len(self._stops)
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._tokens = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    @property
    def stopped(self) -> bool:
        """True once the output reached a stop string; no more text will be emitted."""
        return self.stop_string is not None

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta returned)."""
        return "".join(self._emitted)

    def add(self, token_id: int) -> str:
        """Take the next generated token; return the text to stream for it (maybe "")."""
        if self._flushed:
            raise RuntimeError("add() after flush(): the request already finished")
        if self.stopped:
            # The engine may have sampled a token past the stop before the scheduler saw it.
            return ""
        self._tokens.append(token_id)
        self._added += 1
        return self._emit(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """End of generation: return all text still held back (call once, after the last add)."""
        if self._flushed:
            return ""
        self._flushed = True
        if self.stopped:
            return ""
        return self._emit(self._decode_new(final=True), final=True)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._tokens[start:end],
                                     skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens since `_read_offset` that is complete enough to emit."""
        if self._read_offset == len(self._tokens):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        # Decoding from the prefix, not from the new token, gives the decoder the context it
        # needs (leading spaces, the earlier bytes of a multi-byte character).
        new_text = self._decode(self._prefix_offset)
        held = len(self._tokens) - self._read_offset
        if not final and held <= MAX_HELD_TOKENS and (
                new_text.endswith(REPLACEMENT_CHAR) or len(new_text) <= len(self._prefix_text)):
            # An incomplete character (or a token that decodes to nothing yet, e.g. a skipped
            # special token): wait for more tokens.
            return ""
        delta = new_text[len(self._prefix_text):]
        # Slide the window: the tokens just emitted become the next call's context.
        del self._tokens[:self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._prefix_text = None
        return delta

    def _emit(self, delta: str, final: bool) -> str:
        """Apply stop strings to the new text; record and return what may be streamed now."""
        if not self._stops or self._added < self.min_tokens:
            if delta:
                self._emitted.append(delta)
            return delta
        buf = self._pending + delta
        # Stop at the occurrence that completes first — where generation char by char would
        # have stopped — so the result does not depend on how the text was split into tokens.
        # Only `delta` needs reading: each stop string's matcher already went through the rest.
        cut = self._first_stop(buf, len(self._pending))
        if cut is not None:
            out = buf[:cut[0] + (len(cut[1]) if self.include_stop else 0)]
            self.stop_string = cut[1]
            self._pending = ""
        elif final:
            out, self._pending = buf, ""
        else:
            # Text that could begin a stop string is held back, never emitted.
            hold = min(max(self._matched), len(buf))
            out, self._pending = buf[:len(buf) - hold], buf[len(buf) - hold:]
        if out:
            self._emitted.append(out)
        return out

    def _first_stop(self, buf: str, start: int) -> tuple[int, str] | None:
        """Feed buf[start:] to every stop string's matcher (Knuth-Morris-Pratt): where the stop
        string that completes first begins, and which it is; None when none completes. Work is
        linear in the new text (amortized), whatever the stop strings' lengths."""
        cut: tuple[int, int, str] | None = None            # (end, -length, stop string)
        for n, (s, fail) in enumerate(zip(self._stops, self._failures)):
            k = self._matched[n]
            for j in range(start, cut[0] if cut else len(buf)):
                c = buf[j]
                while k and s[k] != c:
                    k = fail[k - 1]
                if s[k] == c:
                    k += 1
                    if k == len(s):
                        # Ties on the end go to the longer one: it began first.
                        if cut is None or (j + 1, -k) < cut[:2]:
                            cut = (j + 1, -k, s)
                        k = fail[k - 1]
                        break
            self._matched[n] = k
        return None if cut is None else (cut[0] + cut[1], cut[2])


def _failure(s: str) -> tuple[int, ...]:
    """f[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return tuple(f)
