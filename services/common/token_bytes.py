"""Each token's bytes, as logprobs report them (OpenAI's `bytes`; our TokenLogprob.token_bytes).

A byte-level BPE token may hold part of a UTF-8 character (an emoji spans several tokens), so a
token's text alone cannot say what it is; its bytes can. llguidance's tokenizer (the grammar
engine's, services/common/grammar.py) reads them from tokenizer.json for every tokenizer kind
(byte-level, SentencePiece byte fallback); special tokens come back as their text.
"""
from __future__ import annotations

import threading

from tokenizers import Tokenizer

# One table per tokenizer object (a process holds one or two): building one takes ~0.2 s.
_TABLES: dict[int, tuple[Tokenizer, object]] = {}
_LOCK = threading.Lock()


def byte_table(tokenizer):
    """llguidance's tokenizer for `tokenizer` (a tokenizers.Tokenizer, or an object holding one as
    `.tokenizer`), built once: any thread; call it off the event loop before first use. Its
    `decode_bytes([token_id])` gives a token's bytes."""
    tokenizer: Tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    entry = _TABLES.get(id(tokenizer))
    if entry is None:
        with _LOCK:
            entry = _TABLES.get(id(tokenizer))
            if entry is None:
                from llguidance import LLTokenizer
                entry = _TABLES[id(tokenizer)] = (tokenizer, LLTokenizer(tokenizer.to_str()))
    return entry[1]
