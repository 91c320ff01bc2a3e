"""The `prompt` of OpenAI's completions: a string, token ids, or a batch of either. Pure: the
JSON value in, a list of prompts out (each a string or a list of token ids), or INVALID naming
the element at fault (`prompt[2]`, `prompt[1][7]`).

    "text"                  one prompt
    ["a", "b"]              two prompts: their choices are indexed prompt by prompt (OpenAI's order)
    [1, 2, 3]               one prompt of token ids (the served model's; the scheduler checks
                            each is in its vocabulary)
    [[1, 2], [3]]           two prompts of token ids

and `echo`, which puts the prompt before the answer (echo_sampling), and vLLM's
`prompt_logprobs` (prompt_logprob_sampling).
"""
from __future__ import annotations

from services.common.errors import invalid
from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.common.step import MAX_TOP_LOGPROBS
from services.router.openai_api.json_fields import json_kind, text_field

MAX_PROMPTS = 64             # prompts in one request; with n, choices in one request (each a sequence)
MAX_TOKEN_ID = 2**32 - 1     # the wire's uint32; the scheduler checks the model's vocabulary


def parse_prompts(value) -> list[str | list[int]]:
    if isinstance(value, str):
        return [text_field(value, "prompt", allow_empty=False)]
    if not isinstance(value, list):
        raise invalid(f"prompt must be a string, a list of strings, a list of token ids or a list of lists "
                      f"of token ids, got {json_kind(value)}", "prompt")
    if not value:
        raise invalid("prompt must not be empty", "prompt")
    if _is_id(value[0]):
        return [_token_ids(value, "prompt")]
    if len(value) > MAX_PROMPTS:
        raise invalid(f"prompt has {len(value)} prompts; at most {MAX_PROMPTS} are served in one request", "prompt")
    kinds = {json_kind(v) for v in value}
    if kinds == {"string"}:
        return [text_field(v, f"prompt[{i}]", allow_empty=False) for i, v in enumerate(value)]
    if kinds == {"array"}:
        return [_token_ids(v, f"prompt[{i}]") for i, v in enumerate(value)]
    bad = next(i for i, v in enumerate(value) if json_kind(v) != json_kind(value[0]) or json_kind(v) not in
               ("string", "array"))
    raise invalid(f"prompt[{bad}] is {json_kind(value[bad])}: a batch is all strings or all lists of token ids",
                  f"prompt[{bad}]")


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: list, field: str) -> list[int]:
    if not value:
        raise invalid(f"{field} must not be empty", field)
    for i, token_id in enumerate(value):
        if not _is_id(token_id) or not 0 <= token_id <= MAX_TOKEN_ID:
            raise invalid(f"{field}[{i}] must be a token id (an integer from 0), got "
                          f"{token_id if _is_id(token_id) else json_kind(token_id)}", f"{field}[{i}]")
    return value


def set_prompt(body: router_pb2.GenerateRequest, prompt: str | list[int]) -> None:
    """One prompt into a request: its text or its token ids."""
    if isinstance(prompt, str):
        body.prompt = prompt
    else:
        body.prompt_token_ids[:] = prompt


def echo_sampling(sampling: common_pb2.SamplingParams, prompts: list[str | list[int]]) -> None:
    """`echo`: the answer's text starts with the prompt's; with `logprobs` N, its logprobs with
    the prompt tokens' (each given the tokens before it; the first has none) and their N most
    likely, which the scheduler's first chunk brings (sampling.prompt_logprobs). A prompt of
    token ids needs those entries for its text even without logprobs (their logprobs unused)."""
    if sampling.HasField("logprobs"):
        sampling.prompt_logprobs = sampling.logprobs
    elif any(not isinstance(p, str) for p in prompts):
        sampling.prompt_logprobs = 0


def prompt_logprob_sampling(body: dict, request) -> None:
    """What the scheduler's first chunk must bring of the prompt (sampling.prompt_logprobs, the
    larger N of the two): for `echo` (completions: echo_sampling), and for vLLM's
    `prompt_logprobs` N (0-20; chat and completions, not streamed, as vLLM serves it): each prompt
    token's logprob given the tokens before it, its rank, and the N most likely there."""
    if request.echo:
        echo_sampling(request.body.sampling, request.prompts)
        if request.body.sampling.max_tokens == 0:
            # OpenAI's legacy scoring call (and vLLM's): the prompt and its logprobs, nothing after.
            # The model computes one token, which the router drops and nobody is billed for
            # (RequestHead.prompt_only).
            request.prompt_only, request.body.sampling.max_tokens = True, 1
    value = body.get("prompt_logprobs")
    if value is None:
        return
    if not _is_id(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid(f"prompt_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got "
                      f"{value if _is_id(value) else json_kind(value)}", "prompt_logprobs")
    if request.stream:
        raise invalid("prompt_logprobs is not served on a stream: send stream: false (as vLLM)", "prompt_logprobs")
    request.prompt_logprobs = value
    s = request.body.sampling
    s.prompt_logprobs = max(value, s.prompt_logprobs) if s.HasField("prompt_logprobs") else value
