"""The simulated workers' "model": the next token is a hash of the sequence's tokens so far (and its
sampling seed), so a request's fault-free output is known exactly, whatever ran it and however
often it was recomputed. Text is one letter per token."""
from __future__ import annotations

VOCAB = 200
EOS = 2                 # the model's end-of-sequence token (unless ignore_eos)
FIRST_TOKEN = 3         # 0..2 are special


def next_token(tokens: list[int] | tuple[int, ...], seed: int | None) -> int:
    """Deterministic in every process (a tuple of ints hashes the same everywhere)."""
    h = hash((seed or 0, len(tokens), tuple(tokens)))
    if h % 53 == 0:
        return EOS
    return FIRST_TOKEN + (h >> 7) % (VOCAB - FIRST_TOKEN)


class LetterDecoder:
    """A tokenizer's decode for the detokenizer: a letter per token, nothing for special ones."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids if i >= FIRST_TOKEN or not skip_special_tokens)


def expected_tokens(prompt: list[int], seed: int | None, max_tokens: int, ignore_eos: bool) -> list[int]:
    """The output a fault-free run streams (before any stop string)."""
    tokens = list(prompt)
    out = []
    while len(out) < max_tokens:
        token = next_token(tokens, seed)
        tokens.append(token)
        out.append(token)
        if token == EOS and not ignore_eos:
            break
    return out
