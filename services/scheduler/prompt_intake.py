"""A request's prompt as the model's token ids, at the scheduler (the router holds no tokenizer):

    tokenized(submit, tokenizer, model)       token ids as sent, a prompt tokenized, or messages
                                              rendered with the chat template and its options
    truncated(ids, sampling, max_context)     the last k of them (truncate_prompt_tokens)
    check_allowed(sampling, vocab, eos_ids)   allowed_token_ids the model has, and that can end
                                              the answer's first min_tokens without a stop token
    forbidden(sampling, tokenizer)            bad_words checked, as token sequences (vLLM's)

Run in a tokenizer thread (server.py): no asyncio here. Errors are INVALID naming the field as the
gRPC request has it (the HTTP front maps them to its parameters).
"""
from __future__ import annotations

from services.common.bad_words import bad_word_ids, check_bad_words
from services.common.chat_options import chat_render
from services.common.errors import invalid
from services.common.grammar import check_admissible
from services.common.proto.qos.v1 import common_pb2, scheduler_pb2
from services.common.step import guides_set
from services.common.token_bytes import byte_table
from services.common.tokenizer import TextTokenizer
from services.scheduler.admission import DEFAULT_MAX_TOKENS
from services.scheduler.chat_tools import chat_turns
from services.scheduler.request import check_token_ids


def tokenized(submit: scheduler_pb2.SubmitRequest, tokenizer: TextTokenizer, model: str) -> list[int]:
    if submit.sampling.HasField("logprobs") or submit.sampling.HasField("prompt_logprobs"):
        byte_table(tokenizer)      # for the chunks' token bytes: built once, off the event loop
    # A structured output the workers could not compile, or whose first mask needs more work than
    # a step allows, is refused here, at once (not after waiting its turn, failing in a step).
    if guides_set(submit.sampling):
        check_admissible(submit.sampling, byte_table(tokenizer))
    if submit.prompt_token_ids:
        check_token_ids(submit.prompt_token_ids, tokenizer.vocab_size, "prompt_token_ids")
        return list(submit.prompt_token_ids)
    if not submit.messages:
        return tokenizer.encode(submit.prompt)
    render = chat_render(submit.chat_template)
    messages, tools = chat_turns(submit, tokenizer.chat_template, model)
    try:
        return tokenizer.encode_chat(messages, tools, render)
    except ValueError as exc:   # no template, or the template refused the conversation
        field = "chat_template.continue_final_message" if "continue_final_message" in str(exc) else "messages"
        raise invalid(f"messages: {exc}", field=field) from exc


def truncated(ids: list[int], sampling: common_pb2.SamplingParams, max_context: int) -> list[int]:
    """The prompt's last truncate_prompt_tokens tokens (all of them when unset or fewer); -1: as
    many as leave room in the context window for max_tokens (unset: the default, at most half
    the window)."""
    if not sampling.HasField("truncate_prompt_tokens"):
        return ids
    keep = sampling.truncate_prompt_tokens
    if keep == -1:
        answer = sampling.max_tokens if sampling.HasField("max_tokens") else min(DEFAULT_MAX_TOKENS, max_context // 2)
        keep = max_context - answer
        if keep < 1:
            raise invalid(f"sampling.truncate_prompt_tokens -1 keeps what leaves room for max_tokens={answer} in the "
                          f"context window of {max_context} tokens: nothing", "sampling.truncate_prompt_tokens")
    elif not 1 <= keep <= max_context:
        raise invalid(f"sampling.truncate_prompt_tokens must be -1 or in 1..{max_context} (the context window), "
                      f"got {keep}", "sampling.truncate_prompt_tokens")
    return ids[-keep:] if len(ids) > keep else ids


def check_allowed(sampling: common_pb2.SamplingParams, vocab_size: int, eos_ids) -> None:
    """allowed_token_ids: each a token of the model; with min_tokens, at least one that is not a
    stop token (else no token could be sampled before min_tokens)."""
    allowed = sampling.allowed_token_ids
    if not allowed:
        return
    check_token_ids(allowed, vocab_size, "sampling.allowed_token_ids")
    ends = {*sampling.stop_token_ids, *(() if sampling.ignore_eos else eos_ids)}
    if sampling.min_tokens and set(allowed) <= ends:
        raise invalid(f"sampling.allowed_token_ids holds only stop tokens, so none may be sampled before "
                      f"min_tokens={sampling.min_tokens}: allow another token, or drop min_tokens",
                      "sampling.allowed_token_ids")


def forbidden(sampling: common_pb2.SamplingParams, tokenizer: TextTokenizer) -> tuple[tuple[int, ...], ...]:
    """The bad words' token sequences (checked here too: the scheduler's RPCs take them directly)."""
    check_bad_words(sampling)
    return bad_word_ids(sampling.bad_words, tokenizer.encode)
