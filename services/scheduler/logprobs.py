"""Logprobs on their way from a worker's answer to the client's chunks (sampling.logprobs).

A step's answer carries them beside its tokens (worker.proto's logprob lists); postprocess keeps
each on its request (`record`) as it records the token, and the token's chunk takes it (`entry`)
when it is made, after the next plans are sent (stream_out.py). So every chunk carries exactly the
logprobs of its token_ids: a preempted or failed-over request's earlier tokens were streamed with
theirs already, and a request migrated from another pool (resume) gets entries only for the
tokens generated here, after the ones that pool streamed.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping

from services.common.proto.qos.v1 import common_pb2, worker_pb2
from services.common.step import TokenLogprobs
from services.common.token_bytes import byte_table
from services.common.wire import answer_logprobs
from services.scheduler.request import Phase, Request

log = logging.getLogger(__name__)


def record(result: worker_pb2.StepResult, by_seq: Mapping[int, Request]) -> None:
    """The answer's logprobs onto the requests whose tokens postprocess records (the same test)."""
    for seq_id, logprobs in answer_logprobs(result).items():
        request = by_seq.get(seq_id)
        if request is None or request.phase is not Phase.RUNNING or request.cancelled:
            continue
        if request.logprobs is None:
            request.logprobs = deque()
        request.logprobs.append(logprobs)


def entry(request: Request, token_id: int) -> common_pb2.TokenLogprob | None:
    """The chunk entry of the request's next token, `token_id`; None if it has none (logprobs
    not asked for)."""
    if not request.logprobs:
        return None
    logprobs: TokenLogprobs = request.logprobs.popleft()
    return chunk_entry(byte_table(request.detokenizer.tokenizer), token_id, logprobs.logprob, logprobs.top)


def chunk_entry(table, token_id: int, logprob: float, top: Iterable[tuple[int, float]] = (),
                rank: int = 0) -> common_pb2.TokenLogprob:
    """A token's entry for a chunk, its and its top tokens' bytes from the tokenizer's `table`."""
    return common_pb2.TokenLogprob(
        token_id=token_id, logprob=logprob, token_bytes=table.decode_bytes([token_id]), rank=rank,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp, token_bytes=table.decode_bytes([t])) for t, lp in top])


def record_prompt(result: worker_pb2.StepResult, scheduled: list[Request]) -> None:
    """The answer's prompt logprobs onto their requests (sampling.prompt_logprobs), by position;
    a position computed again (after a preemption, on another worker) keeps its first entry."""
    by_seq = {r.seq_id: r for r in scheduled}
    for part in result.prompt_logprobs:
        request = by_seq.get(part.seq_id)
        if request is None or request.prompt_logprobs is None:
            continue
        table = byte_table(request.detokenizer.tokenizer)
        held = request.prompt_logprobs
        for position, e in enumerate(part.entries, part.first_position):
            if position not in held:
                held[position] = chunk_entry(table, e.token_id, e.logprob, ((t.token_id, t.logprob) for t in e.top),
                                             e.rank)


def prompt_entries(request: Request) -> list[common_pb2.TokenLogprob]:
    """The first chunk's prompt entries: every prompt token in order, the first with a NaN
    logprob (nothing comes before it). Taken once: the request collects no more after it."""
    held, request.prompt_logprobs = request.prompt_logprobs, None
    table = byte_table(request.detokenizer.tokenizer)
    prompt = request.prompt_ids
    missing = [p for p in range(1, len(prompt)) if p not in held]
    if missing:     # a scheduler bug: say so where it shows, never a made-up value
        log.error("request %s: no prompt logprobs for %d of its %d prompt positions (first %d)",
                  request.request_id, len(missing), len(prompt), missing[0])
    return [held.get(p) or chunk_entry(table, prompt[p], float("nan")) for p in range(len(prompt))]
