"""vLLM's bad_words: words a request's output must not contain, as token sequences the sampler
forbids (services/engine/sampler.py banned_now). Shared by the router (checks a client's words)
and the scheduler (checks them again on its own RPCs, and tokenizes them).

    check_bad_words(sampling)          the words' count and sizes, and no other field that says
                                       which tokens may come (a structured output, allowed ids)
    bad_word_ids(words, encode)        each word as it starts the text, and after a space
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from services.common.errors import invalid
from services.common.step import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, guides_set


def check_bad_words(s) -> None:
    """A common_pb2.SamplingParams' bad_words: INVALID naming the field (`sampling.bad_words[i]`)."""
    if not s.bad_words:
        return
    if len(s.bad_words) > MAX_BAD_WORDS:
        raise invalid(f"sampling.bad_words has {len(s.bad_words)} words, at most {MAX_BAD_WORDS} are allowed",
                      "sampling.bad_words")
    for i, word in enumerate(s.bad_words):
        if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise invalid(f"sampling.bad_words[{i}] must be 1 to {MAX_BAD_WORD_CHARS} characters, not only spaces",
                          f"sampling.bad_words[{i}]")
    other = (guides_set(s) or ["allowed_token_ids" if s.allowed_token_ids else ""])[0]
    if other:
        raise invalid(f"sampling.bad_words and sampling.{other} both say which tokens may come: set one of them",
                      "sampling.bad_words")


def bad_word_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """Each word as it starts the text and as it follows a space (vLLM's rule: the second only
    where the space makes a different first token and as many tokens)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        out.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return tuple(out)
