"""Does a worker's answer match the plan it was sent? A worker that answers wrongly is failed.

A step's plan tells the worker which sequences to compute and how many tokens of each; the worker
must sample exactly one token for each sequence whose known tokens the step completes (its last
prompt chunk, or a decode) and none for the others. An answer that misses such a token, samples
one twice, samples for a sequence still mid-prompt, or names a sequence the plan did not carry
comes from a broken worker (a bug, a stuck device, a stale process, or an impostor): trusting it
would stall those requests for good (a sequence without its token is never planned again) or
stream tokens that are not theirs. The batcher then treats the worker as failed: its sequences
are recomputed elsewhere and it is kept out of the pool for a while (ContinuousBatcher.quarantine).

Sequences that stopped running while the step computed (cancelled, failed) may or may not have a
token: the worker did not know.
"""
from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.request import Phase, Request


def answer_mismatch(scheduled: Sequence[Request], sampled_seq_ids: Sequence[int]) -> str | None:
    """What is wrong with the answer, in words; None when it matches the plan. Call after the
    scheduled requests were advanced by the step's tokens (`pending` 0: the step completed them)."""
    got = set(sampled_seq_ids)
    due = {r.seq_id for r in scheduled if r.phase is Phase.RUNNING and not r.pending}
    if got == due and len(sampled_seq_ids) == len(due):
        return None                                  # the common case, in two set operations
    problems = []
    if len(got) != len(sampled_seq_ids):
        problems.append(f"{len(sampled_seq_ids) - len(got)} sequence(s) sampled twice")
    planned = {r.seq_id for r in scheduled}
    if unknown := got - planned:
        problems.append(f"tokens for {len(unknown)} sequence(s) not in the plan (e.g. {min(unknown)})")
    if missing := due - got:
        problems.append(f"no token for {len(missing)} of the {len(due)} sequence(s) the step completed")
    mid_prompt = {r.seq_id for r in scheduled if r.phase is Phase.RUNNING and r.pending}
    if early := got & mid_prompt:
        problems.append(f"tokens for {len(early)} sequence(s) still mid-prompt")
    return "; ".join(problems) or None
