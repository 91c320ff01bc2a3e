"""How a conversation becomes a prompt: vLLM's chat options (common.proto ChatTemplateOptions),
checked the same way at the router's two fronts and at the scheduler that renders them. Pure.

    add_generation_prompt    true (default): the template's opening of the assistant's turn ends
                             the prompt; false: the prompt ends with the last message's turn
    continue_final_message   the prompt ends inside the final message, which the model continues
                             (an answer the client began); not with add_generation_prompt true
    chat_template_kwargs     extra variables for the template (a JSON object, e.g. a template's
                             `enable_thinking`), at most MAX_KWARGS_BYTES as JSON text; not the
                             names the renderer sets itself (RESERVED)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from services.common.errors import invalid

MAX_KWARGS_BYTES = 16 * 1024
# Variables the renderer passes itself (services/common/tokenizer.py ChatTemplate.render): a
# client's value would replace the conversation, or a function, with its own.
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"})


@dataclass(slots=True, frozen=True)
class ChatRender:
    """The options as the renderer takes them; the defaults are a prompt ready for the reply."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict = field(default_factory=dict)


DEFAULT_RENDER = ChatRender()


def check_kwargs(text: str, field: str = "chat_template.kwargs_json") -> dict:
    """chat_template_kwargs' JSON text as a dict of template variables; INVALID naming `field`
    (or its key) when it is not an object of at most MAX_KWARGS_BYTES, or sets a reserved name."""
    if not text:
        return {}
    if len(text.encode()) > MAX_KWARGS_BYTES:
        raise invalid(f"{field} is {len(text.encode())} bytes of JSON, at most {MAX_KWARGS_BYTES} are allowed",
                      field)
    try:
        kwargs = json.loads(text)
    except ValueError as exc:
        raise invalid(f"{field} is not JSON: {exc}", field) from None
    if not isinstance(kwargs, dict):
        raise invalid(f"{field} must be a JSON object of template variables", field)
    try:        # a \ud800-style escape decodes to a lone surrogate, which no prompt can carry
        json.dumps(kwargs, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise invalid(f"{field} holds a string that is not valid Unicode (a lone surrogate)", field) from None
    for name in kwargs:
        if name in RESERVED:
            raise invalid(f"{field} sets {name!r}, which the server sets itself (the conversation and its "
                          f"options are fields of their own): {', '.join(sorted(RESERVED))} are refused",
                          f"{field}.{name}")
    return kwargs


def chat_render(options, prefix: str = "chat_template.") -> ChatRender:
    """A ChatTemplateOptions (or its bytes twin, decoded) checked into a ChatRender; errors name
    `prefix` + the option."""
    add = options.add_generation_prompt if options.HasField("add_generation_prompt") else not options.continue_final_message
    if add and options.continue_final_message:
        raise invalid("continue_final_message and add_generation_prompt cannot both be true: continue the final "
                      "message, or open a new assistant turn", f"{prefix}continue_final_message")
    return ChatRender(add, options.continue_final_message, check_kwargs(options.kwargs_json, f"{prefix}kwargs_json"))


def options_set(options) -> bool:
    """Whether a ChatTemplateOptions asks for anything but the defaults."""
    return (options.HasField("add_generation_prompt") and not options.add_generation_prompt) \
        or options.continue_final_message or bool(options.kwargs_json)
