"""The model's tokenizer and chat template, without torch or transformers.

Uses the `tokenizers` library on tokenizer.json and renders the chat template (from
chat_template.jinja, or tokenizer_config.json's `chat_template`) with a sandboxed Jinja
environment, as transformers does. The scheduler tokenizes with this; so do benchmarks.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from services.common.chat_options import DEFAULT_RENDER, ChatRender


def _raise_template_error(message: str):
    raise ValueError(f"chat template error: {message}")


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _open_final_message(text: str, messages: list[dict]) -> str:
    """The rendered conversation cut right after the final message's text, so that the model
    continues that message (what transformers' continue_final_message does): the template's
    end-of-turn after it goes. A template that trims the message's spaces keeps them trimmed."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs text in the final message to continue")
    at = text.rfind(final.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the final message as "
                         "it was sent, so there is no place to continue it from")
    whole = len(final.lstrip())
    return text[:at + whole] if text[at:at + whole] == final.lstrip() else text[:at + len(final.strip())]


@dataclass(slots=True)
class ChatTemplate:
    source: str
    bos_token: str | None
    eos_token: str | None
    # Compiled at the first render and kept: compiling takes ~4 ms of Python, rendering ~0.03 ms,
    # and every chat request renders. (Compiled per call, it held the scheduler's GIL for ~4 ms a
    # request, in the tokenizer threads, while the event loop waited for it.)
    _compiled: Template | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def has_tool_format(self) -> bool:
        """Whether the template renders a `tools` list (OpenAI function specs), as templates with a
        tool-call format do (Qwen2.5, Llama 3.1, Hermes, ...)."""
        return "tools" in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               continue_final_message: bool = False, kwargs: dict | None = None) -> str:
        """The conversation as the template writes it. `kwargs`: the client's extra variables
        (checked by services/common/chat_options.py: none of the names set here)."""
        if self._compiled is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._compiled = env.from_string(self.source)
        text = self._compiled.render(
            **(kwargs or {}), messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            **({"tools": tools} if tools else {}))
        return _open_final_message(text, messages) if continue_final_message else text


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate | None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "TextTokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        tokenizer = Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = model_dir / "chat_template.jinja"
        source = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        if isinstance(source, list):  # named templates: use the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        template = None
        if source:
            template = ChatTemplate(source, _token_text(config.get("bos_token")),
                                    _token_text(config.get("eos_token")))
        return cls(tokenizer, template)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not), so a long prompt
        # tokenized in a helper thread leaves the caller's event loop running; same ids, ~same cost.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def encode_chat(self, messages: list[dict], tools: list | None = None,
                    render: ChatRender = DEFAULT_RENDER) -> list[int]:
        """Token ids of `messages` rendered with the chat template (and `tools`, for a template
        with a tool format), by default ready for the reply (`render`: the client's options)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt")
        text = self.chat_template.render(messages, render.add_generation_prompt, tools,
                                         render.continue_final_message, render.kwargs)
        # The template already writes any BOS; don't let the tokenizer add a second one.
        return self.encode(text, add_special_tokens=False)
