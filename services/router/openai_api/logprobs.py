"""Our chunks' logprob entries (common.proto TokenLogprob) as OpenAI's logprobs objects. Pure.

    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                 "bytes"}]}], "refusal": null}
    completions  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
                 "text_offset": [...]}   (the legacy shape: each top_logprobs dict holds the N most
                 likely tokens and the chosen one, so up to N + 1 entries)

A token's text is its bytes decoded on their own, a part of a character shown as U+FFFD; `bytes`
is exact, and the bytes of consecutive tokens join into the text. `text_offset` counts the
characters of those token texts from the start of the completion (of the prompt, when it is
echoed), across a stream's chunks (as vLLM counts them).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from services.common.proto.qos.v1 import common_pb2


def token_text(token_bytes: bytes) -> str:
    return token_bytes.decode("utf-8", errors="replace")


class LogprobsView:
    """The logprobs objects of one response, chunk after chunk (or all at once). `as_ids`: vLLM's
    return_tokens_as_token_ids, each token named "token_id:N" (a token whose bytes are not text
    on their own stays identifiable); `bytes` and `text_offset` stay the text's."""

    def __init__(self, chat: bool, as_ids: bool = False):
        self.chat = chat
        self.name = (lambda e: f"token_id:{e.token_id}") if as_ids else (lambda e: token_text(e.token_bytes))
        self.offset = 0          # completions: characters of the token texts given so far

    def of(self, entries: Sequence[common_pb2.TokenLogprob]) -> dict:
        """The object for these entries, the next ones of the response."""
        if self.chat:
            return {"content": [{**self._top(e), "top_logprobs": [self._top(t) for t in e.top]} for e in entries],
                    "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(token_text(e.token_bytes))
        # An echoed prompt's first token has no logprob (nothing comes before it): null, as OpenAI's.
        return {"tokens": [self.name(e) for e in entries],
                "token_logprobs": [None if math.isnan(e.logprob) else e.logprob for e in entries],
                "top_logprobs": [None if math.isnan(e.logprob) else
                                 {**{self.name(t): t.logprob for t in e.top}, self.name(e): e.logprob}
                                 for e in entries],
                "text_offset": offsets}

    def _top(self, entry) -> dict:
        return {"token": self.name(entry), "logprob": entry.logprob, "bytes": list(entry.token_bytes)}


def vllm_prompt_logprobs(entries: Sequence[common_pb2.TokenLogprob], k: int) -> list:
    """vLLM's `prompt_logprobs`: None for the first prompt token (nothing comes before it), then for
    each a map of token id (as text) -> {"logprob", "rank", "decoded_token"}: the prompt token's own
    and the k most likely tokens' there (as many as k + 1)."""
    out: list = [None]
    for e in entries[1:]:
        position = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": token_text(e.token_bytes)}}
        for rank, t in enumerate(e.top[:k], 1):
            position.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": rank,
                                                  "decoded_token": token_text(t.token_bytes)})
        out.append(position)
    return out
