"""vLLM's extra request fields that change what is generated or how it is shown, on the OpenAI
front, read as vLLM reads them. Pure: the body in, the request's fields set, or INVALID naming the
field.

    include_stop_str_in_output   the stop string that ended the answer stays at its end
    skip_special_tokens          false: special tokens are written in the answer's text
    return_tokens_as_token_ids   logprobs' tokens as "token_id:N" (bytes and offsets stay the text's)
    return_token_ids             the prompt's token ids and each choice's (response.py shows them)
    allowed_token_ids            only these tokens may be sampled (at most MAX_ALLOWED_TOKEN_IDS)
    bad_words                    words the answer must not contain (at most MAX_BAD_WORDS)
    truncate_prompt_tokens       only the prompt's last k tokens; -1: what leaves room for the answer
    add_generation_prompt,       chat: how the conversation is rendered (services/common/
    continue_final_message,      chat_options.py); on completions only at their defaults (there is
    chat_template_kwargs         no template there)

`spaces_between_special_tokens` is taken either way (our tokenizers decode without adding any).
"""
from __future__ import annotations

import json

from services.common.chat_options import check_kwargs
from services.common.errors import invalid
from services.common.step import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS
from services.router.openai_api.json_fields import bool_field, int_field, text_field

MAX_INT32 = 2**31 - 1
SAMPLING = {"include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids", "truncate_prompt_tokens",
            "return_tokens_as_token_ids", "bad_words", "return_token_ids"}
CHAT_TEMPLATE = {"add_generation_prompt", "continue_final_message", "chat_template_kwargs"}


def parse_vllm_options(body: dict, request, chat: bool) -> None:
    """The fields above onto `request` (an OpenAIRequest): its sampling, its chat template
    options (chat only), and how its logprobs are shown."""
    s = request.body.sampling
    if body.get("include_stop_str_in_output") is not None:
        s.include_stop_str_in_output = bool_field(body["include_stop_str_in_output"], "include_stop_str_in_output")
    if body.get("skip_special_tokens") is not None:
        s.skip_special_tokens = bool_field(body["skip_special_tokens"], "skip_special_tokens")
    if body.get("return_tokens_as_token_ids") is not None:
        request.tokens_as_ids = bool_field(body["return_tokens_as_token_ids"], "return_tokens_as_token_ids")
    if body.get("return_token_ids") is not None:
        request.token_ids = s.return_token_ids = bool_field(body["return_token_ids"], "return_token_ids")
    if body.get("truncate_prompt_tokens") is not None:
        keep = int_field(body["truncate_prompt_tokens"], "truncate_prompt_tokens", -1, MAX_INT32)
        if keep == 0:
            raise invalid("truncate_prompt_tokens must be -1 (what leaves room for the answer) or a number of "
                          "tokens from 1, got 0", "truncate_prompt_tokens")
        if request.echo:
            raise invalid("truncate_prompt_tokens cannot be combined with echo: the echo repeats the prompt as sent, "
                          "the model would read only its end", "truncate_prompt_tokens")
        s.truncate_prompt_tokens = keep
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed or len(allowed) > MAX_ALLOWED_TOKEN_IDS:
            raise invalid(f"allowed_token_ids must be a list of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids",
                          "allowed_token_ids")
        s.allowed_token_ids.extend(int_field(v, f"allowed_token_ids[{i}]", 0, MAX_INT32)
                                   for i, v in enumerate(allowed))
    words = body.get("bad_words")
    if words is not None and words != []:       # vLLM's default is []
        if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
            raise invalid(f"bad_words must be a list of at most {MAX_BAD_WORDS} words", "bad_words")
        s.bad_words.extend(text_field(word, f"bad_words[{i}]", allow_empty=False) for i, word in enumerate(words))
    if chat:
        parse_chat_template(body, request.body.chat_template)


def parse_chat_template(body: dict, options) -> None:
    """The chat template options of a body (chat, /tokenize with messages) onto a ChatTemplateOptions."""
    for name in ("add_generation_prompt", "continue_final_message"):
        if body.get(name) is not None:
            setattr(options, name, bool_field(body[name], name))
    if options.continue_final_message and options.HasField("add_generation_prompt") and options.add_generation_prompt:
        raise invalid("continue_final_message and add_generation_prompt cannot both be true: continue the final "
                      "message, or open a new assistant turn", "continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise invalid("chat_template_kwargs must be an object of template variables", "chat_template_kwargs")
        text = json.dumps(kwargs, separators=(",", ":"))
        check_kwargs(text, "chat_template_kwargs")     # its size, and no name the renderer sets
        if kwargs:
            options.kwargs_json = text
