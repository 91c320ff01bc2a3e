"""Prompts built from a trace's hash ids (bench/trace_replay.py): each hash id is a fixed run of
exactly `tokens_per_hash` tokens of the model's tokenizer, the same run wherever the id appears,
so requests that share hash ids share token prefixes, and so share KV blocks on the server.

A run is words each of which, with its leading space, is one token of the tokenizer (" river"),
picked from the tokenizer's own vocabulary. A byte-level BPE tokenizer splits text before each
space-led word and never merges across that split, so the text of block i cannot merge with
block i+1's into other tokens at the boundary; `exact_blocks` checks it by tokenizing the
prompts, since a tokenizer of another kind might.

Distinct hash ids get distinct texts: a run's first words are the id's digits in base V (the
vocabulary's size, 1,024 by default), as many as the trace's largest id needs; the rest are drawn
from a generator seeded by the id. With fewer tokens per hash id than that (one token per id of a
trace with more than V ids), two ids may share a text; `distinct` says whether that can happen.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence

from services.common.tokenizer import TextTokenizer

VOCAB_SIZE = 1024
WORD = re.compile(r" [a-z]{3,}")


def one_token_words(tokenizer: TextTokenizer, size: int = VOCAB_SIZE) -> list[tuple[int, str]]:
    """Up to `size` (token id, text) pairs, lowest ids first (the commonest words in a BPE
    vocabulary), each text a space and 3+ lowercase letters that encodes to that one token."""
    count = tokenizer.vocab_size
    texts = tokenizer.tokenizer.decode_batch([[i] for i in range(count)], skip_special_tokens=False)
    candidates = [(i, t) for i, t in enumerate(texts) if WORD.fullmatch(t)]
    encoded = tokenizer.tokenizer.encode_batch([t for _, t in candidates], add_special_tokens=False)
    words = [(i, t) for (i, t), e in zip(candidates, encoded) if e.ids == [i]]
    if len(words) < 2:
        raise ValueError("the tokenizer has fewer than 2 single-token words (' word'); cannot build prompts")
    return words[:size]


class BlockText:
    """hash id -> its run of tokens; a request's hash ids -> its prompt (text and token ids)."""

    def __init__(self, words: Sequence[tuple[int, str]], tokens_per_hash: int, max_hash_id: int, seed: int = 0):
        if tokens_per_hash < 1:
            raise ValueError(f"tokens_per_hash must be >= 1, not {tokens_per_hash}")
        self.words = list(words)
        self.tokens_per_hash = tokens_per_hash
        self.seed = seed
        self.digits = 1
        while len(self.words) ** self.digits <= max(0, max_hash_id):
            self.digits += 1
        self._runs: dict[int, list[int]] = {}     # hash id -> indices into words

    @property
    def distinct(self) -> bool:
        """Whether every hash id up to the trace's largest has a text of its own."""
        return self.tokens_per_hash >= self.digits

    def run(self, hash_id: int) -> list[int]:
        """The word indices of a hash id's block."""
        if (cached := self._runs.get(hash_id)) is not None:
            return cached
        v, t = len(self.words), self.tokens_per_hash
        rng = random.Random(self.seed * 1_000_003 + hash_id)
        picks = [rng.randrange(v) for _ in range(t)]
        value = hash_id % v ** self.digits          # ids may be negative in a hand-made trace
        for position in range(min(self.digits, t)):
            picks[position] = (value + self.seed) % v   # the seed shifts every digit alike
            value //= v
        self._runs[hash_id] = picks
        return picks

    def block_ids(self, hash_id: int) -> list[int]:
        return [self.words[i][0] for i in self.run(hash_id)]

    def prompt(self, hash_ids: Sequence[int], tokens: int) -> tuple[str, list[int]]:
        """The first `tokens` tokens of the blocks of `hash_ids` in order: text and token ids."""
        picks: list[int] = []
        for hash_id in hash_ids:
            if len(picks) >= tokens:
                break
            picks.extend(self.run(hash_id))
        picks = picks[:tokens]
        return "".join(self.words[i][1] for i in picks), [self.words[i][0] for i in picks]


def exact_blocks(tokenizer: TextTokenizer, prompts: Sequence[tuple[str, list[int]]],
                 tokens_per_hash: int) -> tuple[int, int]:
    """(blocks whose tokens, when the whole prompt text is tokenized, are exactly the ones built,
    blocks in all): the check that block texts do not merge at their boundaries."""
    encoded = tokenizer.tokenizer.encode_batch([text for text, _ in prompts], add_special_tokens=False)
    exact = total = 0
    for (_, built), got in zip(prompts, encoded):
        ids, n = got.ids, len(built)
        # A block is exact if its tokens and all before it are (where the tokens first differ,
        # every later block is shifted too).
        same = next((i for i, (a, b) in enumerate(zip(ids, built)) if a != b), min(len(ids), n))
        if same == n and len(ids) > n:      # the text made more tokens: the last block is not exact
            same = n - 1
        for start in range(0, n, tokens_per_hash):
            total += 1
            exact += min(start + tokens_per_hash, n) <= same
    return exact, total
