"""Conversions between the in-process dataclasses (services/common/step.py) and their protobuf
messages, each written once: a client's SamplingParams -> ours (scheduler intake), ours ->
EngineSampling (scheduler -> worker) and back (worker), and sampled tokens on the worker hop;
and what a request message gives to tokenize (router estimates, scheduler intake).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.common.proto.qos.v1 import common_pb2, worker_pb2
from services.common.step import FinishReason, PromptLogprobs, SampledToken, SamplingParams, TokenLogprobs

# What a client gets for a field it leaves unset (common.proto documents the same defaults).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_K = 0
DEFAULT_TOP_P = 1.0


def prompt_chars(request) -> int:
    """Characters of a request's prompt and messages' contents (a GenerateRequest or a
    SubmitRequest): the router's token estimates start from it, the scheduler's choice of where
    to tokenize too."""
    # A prompt of token ids counts as the characters its tokens are estimated from (4 each).
    return (len(request.prompt) + len(request.tools) + 4 * len(request.prompt_token_ids)
            + sum(len(m.content) + len(m.tool_calls) for m in request.messages))


def sampling_from_request(s: common_pb2.SamplingParams, max_tokens: int) -> SamplingParams:
    """A client's sampling fields with defaults applied; `max_tokens` already resolved against
    the prompt (the caller knows the context window). Raises ValueError naming a bad field."""
    return SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_k=s.top_k if s.HasField("top_k") else DEFAULT_TOP_K,
        top_p=s.top_p if s.HasField("top_p") else DEFAULT_TOP_P,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=max_tokens, stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        typical_p=s.typical_p if s.HasField("typical_p") else 1.0,
        **_guides(s), **client_adjustments(s))


def client_adjustments(s: common_pb2.SamplingParams) -> dict:
    """A client's logit adjustments (allowed tokens, bias, penalties, min_p) as SamplingParams'
    fields, defaults applied: the router's gRPC front checks them with SamplingParams' own bounds
    too."""
    return _adjustments(s, s.repetition_penalty if s.HasField("repetition_penalty") else 1.0)


def _adjustments(proto, repetition_penalty: float) -> dict:
    """The logit adjustments' fields, as a client's SamplingParams and EngineSampling both have them."""
    return dict(allowed_token_ids=tuple(proto.allowed_token_ids),
                logit_bias=tuple(sorted(proto.logit_bias.items())), presence_penalty=proto.presence_penalty,
                frequency_penalty=proto.frequency_penalty, repetition_penalty=repetition_penalty,
                min_p=proto.min_p, min_tokens=proto.min_tokens)


def _guides(proto) -> dict:
    """The structured output's fields, as a client's SamplingParams and EngineSampling both have them."""
    return dict(json_schema=proto.json_schema, regex=proto.regex, choice=tuple(proto.choice), grammar=proto.grammar)


def engine_sampling(params: SamplingParams) -> worker_pb2.EngineSampling:
    proto = worker_pb2.EngineSampling(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        max_tokens=params.max_tokens, stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, json_schema=params.json_schema, regex=params.regex,
        choice=list(params.choice), grammar=params.grammar, allowed_token_ids=list(params.allowed_token_ids),
        bad_words=[worker_pb2.TokenIds(ids=word) for word in params.bad_words_ids],
        logit_bias=dict(params.logit_bias), presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        min_p=params.min_p, min_tokens=params.min_tokens, typical_p=params.typical_p)
    if params.seed is not None:
        proto.seed = params.seed
    if params.logprobs is not None:
        proto.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        proto.prompt_logprobs = params.prompt_logprobs
    return proto


def sampling_from_engine(proto: worker_pb2.EngineSampling) -> SamplingParams:
    return SamplingParams(temperature=proto.temperature, top_k=proto.top_k, top_p=proto.top_p,
                          seed=proto.seed if proto.HasField("seed") else None,
                          max_tokens=proto.max_tokens, stop_token_ids=tuple(proto.stop_token_ids),
                          ignore_eos=proto.ignore_eos,
                          logprobs=proto.logprobs if proto.HasField("logprobs") else None,
                          prompt_logprobs=proto.prompt_logprobs if proto.HasField("prompt_logprobs") else None,
                          bad_words_ids=tuple(tuple(word.ids) for word in proto.bad_words),
                          typical_p=proto.typical_p or 1.0, **_guides(proto),
                          **_adjustments(proto, proto.repetition_penalty or 1.0))


def sampled_token_proto(token: SampledToken) -> worker_pb2.SampledToken:
    return worker_pb2.SampledToken(seq_id=token.seq_id, token_id=token.token_id,
                                   finish_reason=token.finish_reason or 0)


def answer_tokens(result: worker_pb2.StepResult, tokens: Sequence[SampledToken],
                  packed: bool) -> worker_pb2.StepResult:
    """A step's sampled tokens into its answer: as packed parallel lists when the plan asked for
    them (StepPlan.packed_results), else as a message each (an older scheduler's `tokens`); the
    logprobs of those that carry them in the answer's logprob lists either way."""
    for token in tokens:
        if token.logprobs is not None:
            result.logprob_seq_ids.append(token.seq_id)
            result.token_logprobs.append(token.logprobs.logprob)
            result.top_logprob_counts.append(len(token.logprobs.top))
            result.top_token_ids.extend([t for t, _ in token.logprobs.top])
            result.top_logprobs.extend([lp for _, lp in token.logprobs.top])
    if not packed:
        result.tokens.extend(map(sampled_token_proto, tokens))
        return result
    result.sampled_seq_ids.extend([t.seq_id for t in tokens])
    result.sampled_token_ids.extend([t.token_id for t in tokens])
    for token in tokens:
        if token.finish_reason:
            result.ended_seq_ids.append(token.seq_id)
            result.ended_reasons.append(token.finish_reason)
    return result


def answer_prompt_logprobs(result: worker_pb2.StepResult, prompts: Sequence[PromptLogprobs]) -> None:
    """A step's prompt logprobs into its answer (StepResult.prompt_logprobs)."""
    for p in prompts:
        result.prompt_logprobs.add(seq_id=p.seq_id, first_position=p.first_position, entries=[
            common_pb2.TokenLogprob(token_id=token, logprob=e.logprob, rank=e.rank,
                                    top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top])
            for token, e in zip(p.token_ids, p.entries)])


def sampled_and_ended(result: worker_pb2.StepResult) -> tuple[Iterable[tuple[int, int]], dict[int, int]]:
    """An answer's (seq_id, token_id) pairs, and the wire finish reason of each sequence they
    ended, by seq_id: read from either form (answer_tokens)."""
    if result.tokens:       # a message per token: an older worker's answer
        return ([(t.seq_id, t.token_id) for t in result.tokens],
                {t.seq_id: t.finish_reason for t in result.tokens if t.finish_reason})
    return (zip(result.sampled_seq_ids, result.sampled_token_ids),
            dict(zip(result.ended_seq_ids, result.ended_reasons)))


def sampled_seq_ids(result: worker_pb2.StepResult) -> Sequence[int]:
    """The sequence id of each token an answer sampled, in either form (answer_tokens)."""
    return [t.seq_id for t in result.tokens] if result.tokens else result.sampled_seq_ids


def sampled_tokens(result: worker_pb2.StepResult) -> list[SampledToken]:
    """An answer's sampled tokens, in either form (answer_tokens)."""
    sampled, ended = sampled_and_ended(result)
    logprobs = answer_logprobs(result) if result.logprob_seq_ids else {}
    return [SampledToken(seq_id, token_id, finish_reason(ended.get(seq_id, 0)), logprobs.get(seq_id))
            for seq_id, token_id in sampled]


def answer_logprobs(result: worker_pb2.StepResult) -> dict[int, TokenLogprobs]:
    """The logprobs an answer carries (answer_tokens), by seq_id."""
    out, at = {}, 0
    top_ids, top_lps = result.top_token_ids, result.top_logprobs
    for seq_id, logprob, count in zip(result.logprob_seq_ids, result.token_logprobs,
                                      result.top_logprob_counts):
        out[seq_id] = TokenLogprobs(logprob, tuple(zip(top_ids[at:at + count], top_lps[at:at + count])))
        at += count
    return out


def finish_reason(value: int) -> FinishReason | None:
    """A wire finish reason as ours; None while the sequence goes on."""
    return FinishReason(value) if value else None
