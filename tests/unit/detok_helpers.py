"""The default model's real tokenizer (SmolLM2, byte-level BPE) and small helpers, shared by the
detokenizer and stop-string tests (the fixtures are in conftest.py)."""
from __future__ import annotations

import functools

from tokenizers import Tokenizer

from services.common.tokenizer import TextTokenizer
from services.engine.default_model import default_model_dir
from services.scheduler.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"             # U+FFFD, what a broken character decodes to


@functools.cache
def load_text_tokenizer() -> TextTokenizer:
    return TextTokenizer.from_model_dir(default_model_dir(progress=False))


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def stream(tok, ids, prompt_ids=(), **kwargs) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feed `ids` one at a time; return the deltas, the flush() text and the detokenizer."""
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush(), detok


def byte_token_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One token per byte: the worst split a byte-level model can produce (GPT-2 byte alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    char_of = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    ids = [tok.token_to_id(char_of[b]) for b in data]
    assert None not in ids
    return ids
