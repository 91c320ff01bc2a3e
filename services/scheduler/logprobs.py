"""Logprobs on their way from a worker's answer to the client's chunks (sampling.logprobs).

A step's answer carries them beside its tokens (worker.proto's logprob lists); postprocess keeps
each on its request (`record`) as it records the token, and the token's chunk takes it (`entry`)
when it is made, after the next plans are sent (stream_out.py). So every chunk carries exactly the
logprobs of its token_ids: a preempted or failed-over request's earlier tokens were streamed with
theirs already, and a request migrated from another pool (resume) gets entries only for the
tokens generated here, after the ones that pool streamed.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from services.common.proto.qos.v1 import common_pb2, worker_pb2
from services.common.step import TokenLogprobs
from services.common.token_bytes import byte_table
from services.common.wire import answer_logprobs
from services.scheduler.request import Phase, Request


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
    table = byte_table(request.detokenizer.tokenizer)
    return common_pb2.TokenLogprob(
        token_id=token_id, logprob=logprobs.logprob, token_bytes=table.decode_bytes([token_id]),
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp, token_bytes=table.decode_bytes([t]))
             for t, lp in logprobs.top])
