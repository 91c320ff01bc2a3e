"""SGLang's native POST /generate (for clients written for SGLang's runtime: its RL and batch
users send token ids and read them back). Pure: a body in, the completion request it means; our
chunks out, SGLang's objects. TGI's /generate shares the path (tgi.py): a body with `inputs` is
TGI's, one with `text` or `input_ids` SGLang's.

    {"text" | "input_ids", "sampling_params", "stream", "return_logprob", "top_logprobs_num",
     "logprob_start_len", "return_text_in_logprobs", "rid", "lora_path"}
    -> {"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "length", "length"} |
        {"type": "stop", "matched"}, "prompt_tokens", "completion_tokens", "cached_tokens",
        "e2e_latency", "output_token_logprobs" / "input_token_logprobs" ([logprob, id, text])}}

A list of prompts, or `n` above 1, answers a list (each prompt's n in turn). Streamed, each
`data:` object holds the text and ids so far (SGLang's default, cumulative), then `data: [DONE]`.
The body becomes a completion (`max_new_tokens` -> max_tokens, 128 when unset as SGLang's;
`json_schema` / `regex` / `ebnf` -> structured_outputs; `no_stop_trim` -> the stop string kept;
`top_k` -1 -> none), read by the completion parser; errors are OpenAI's objects naming the field
as this body has it (`sampling_params.max_new_tokens`). Refused by name: what needs what this
server has not (images, embeddings, hidden states, custom logit processors, session ids).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from services.common.errors import ServiceError, invalid
from services.common.proto.qos.v1 import common_pb2
from services.router.openai_api.json_fields import bool_field, int_field, json_kind
from services.router.openai_api.logprobs import token_text
from services.router.openai_api.request import COMPLETION, OpenAIRequest, parse_rewritten, renamed_param
from services.router.openai_api.response import to_json

SGLANG = "sglang"
DEFAULT_MAX_NEW_TOKENS = 128       # SGLang's
# sampling_params -> the completion field (None: handled here)
SAMPLING = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": None,
            "min_p": "min_p", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
            "repetition_penalty": "repetition_penalty", "stop": "stop", "stop_token_ids": "stop_token_ids",
            "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
            "spaces_between_special_tokens": "spaces_between_special_tokens", "n": "n",
            "min_new_tokens": "min_tokens", "sampling_seed": "seed", "json_schema": None, "regex": None,
            "ebnf": None, "no_stop_trim": None}
GUIDES = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
TOP = {"text", "input_ids", "sampling_params", "stream", "return_logprob", "top_logprobs_num", "logprob_start_len",
       "return_text_in_logprobs", "rid", "lora_path"}
# Top-level fields at the values that ask for nothing we lack
NEUTRAL = {"return_hidden_states": (False,), "image_data": (), "audio_data": (), "video_data": (),
           "input_embeds": (), "custom_logit_processor": (), "session_params": (), "bootstrap_host": (),
           "token_ids_logprob": (), "modalities": ()}


@dataclass(slots=True)
class SglangEcho:
    rid: object = None                 # the client's rid(s), shown as meta_info.id
    logprob: bool = False
    top: int = 0
    prompt_logprobs: bool = False      # logprob_start_len 0: the input's logprobs too
    text_in_logprobs: bool = False
    single: bool = True                # one prompt, n 1: an object, else a list
    started: float = field(default_factory=time.perf_counter)

    def param(self, chat_param: str | None) -> str | None:
        if chat_param is None:
            return None
        if (renamed := renamed_param(chat_param, SAMPLING, "sampling_params.")) is not None:
            return renamed
        for ours, sglang in (("top_k", "top_k"), ("include_stop_str_in_output", "no_stop_trim"),
                             ("structured_outputs.json", "json_schema"), ("structured_outputs.regex", "regex"),
                             ("structured_outputs.grammar", "ebnf")):
            if chat_param == ours or chat_param.startswith(ours + "."):
                return "sampling_params." + sglang + chat_param[len(ours):]
        if chat_param.startswith("structured_outputs"):
            return "sampling_params"
        if chat_param.startswith("prompt"):
            return "input_ids" + chat_param[len("prompt"):] if chat_param[len("prompt"):].startswith("[") else "text"
        if chat_param == "model":
            return "lora_path"
        if chat_param == "logprobs":
            return "top_logprobs_num"
        return chat_param


def is_sglang(body: dict) -> bool:
    return "inputs" not in body and ("text" in body or "input_ids" in body)


def parse_sglang(body: dict, model: str) -> OpenAIRequest:
    for name, value in body.items():
        if name in TOP or value is None:
            continue
        if name not in NEUTRAL:
            raise invalid(f"unknown field {name!r} for SGLang's /generate", name)
        if value not in NEUTRAL[name]:
            raise invalid(f"{name} is not supported by this server", name)
    if ("text" in body) == ("input_ids" in body):
        raise invalid("send one of text and input_ids", "text")
    prompt = body.get("text", body.get("input_ids"))
    params = {} if body.get("sampling_params") is None else body["sampling_params"]
    if not isinstance(params, dict):
        raise invalid(f"sampling_params must be an object, got {json_kind(params)}", "sampling_params")
    for name in params:
        if name not in SAMPLING:
            raise invalid(f"unknown sampling parameter {name!r}", f"sampling_params.{name}")
    completion = {"model": body.get("lora_path") or model, "prompt": prompt,
                  **{ours: params[s] for s, ours in SAMPLING.items() if ours and params.get(s) is not None}}
    completion.setdefault("max_tokens", DEFAULT_MAX_NEW_TOKENS)
    if params.get("top_k") not in (None, -1):
        completion["top_k"] = params["top_k"]
    if params.get("no_stop_trim") is not None:
        completion["include_stop_str_in_output"] = bool_field(params["no_stop_trim"], "sampling_params.no_stop_trim")
    guides = {GUIDES[name]: params[name] for name in GUIDES if params.get(name) is not None}
    if guides:       # (json_schema is JSON text in SGLang's body: structured_outputs takes it so)
        completion["structured_outputs"] = guides
    echo = _echo(body)
    if echo.logprob:
        completion["logprobs"] = echo.top
        if echo.prompt_logprobs:
            completion["prompt_logprobs"] = echo.top
        completion["return_token_ids"] = True
    request = parse_rewritten(COMPLETION, completion, echo)
    echo.single = request.choices == 1 and not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)))
    request.stream, request.sglang = body.get("stream") is not None and bool_field(body["stream"], "stream"), echo
    request.token_ids = True
    request.body.sampling.return_token_ids = True
    return request


def _echo(body: dict) -> SglangEcho:
    logprob = body.get("return_logprob") is not None and bool_field(body["return_logprob"], "return_logprob")
    top = body.get("top_logprobs_num")
    start = body.get("logprob_start_len")
    if start is not None and int_field(start, "logprob_start_len", -1, 0) == 0 and not logprob:
        raise invalid("logprob_start_len needs return_logprob", "logprob_start_len")
    return SglangEcho(rid=body.get("rid"), logprob=logprob,
                      top=0 if top is None else int_field(top, "top_logprobs_num", 0, 20),
                      prompt_logprobs=start == 0,
                      text_in_logprobs=body.get("return_text_in_logprobs") is True)


class SglangAnswer:
    """Our chunks as SGLang's answer: an object per choice (a list when the request has several),
    whole, or streamed as the text and ids so far."""

    def __init__(self, request: OpenAIRequest, request_id: str, created: int, priority: int):
        self.echo: SglangEcho = request.sglang
        self.request_id = request_id
        n = request.choices
        self.text = [""] * n
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.entries: list[list] = [[] for _ in range(n)]
        self.prompt_entries: list[list] = [[] for _ in range(n)]
        self.prompt_ids: list[list[int]] = [[] for _ in range(n)]
        self.last: list[common_pb2.GenerateChunk | None] = [None] * n
        self.open = n

    @property
    def finished(self) -> bool:
        return not self.open

    def add(self, index: int, chunk: common_pb2.GenerateChunk) -> None:
        self.text[index] += chunk.text
        self.ids[index] += chunk.token_ids
        self.entries[index] += chunk.logprobs
        if chunk.prompt_logprobs and not self.prompt_entries[index]:
            self.prompt_entries[index] = list(chunk.prompt_logprobs)
        if chunk.prompt_token_ids and not self.prompt_ids[index]:
            self.prompt_ids[index] = list(chunk.prompt_token_ids)
        if chunk.finish_reason:
            self.open -= 1
        self.last[index] = chunk

    def _one(self, k: int) -> dict:
        last = self.last[k]
        meta = {"id": self._rid(k), "finish_reason": None, "prompt_tokens": last.usage.prompt_tokens,
                "completion_tokens": len(self.ids[k]), "cached_tokens": last.usage.cached_tokens,
                "e2e_latency": time.perf_counter() - self.echo.started}
        if last.finish_reason:
            meta["completion_tokens"] = last.usage.completion_tokens
            meta["finish_reason"] = {"type": "length", "length": last.usage.completion_tokens} \
                if last.finish_reason == common_pb2.FINISH_REASON_LENGTH else \
                {"type": "stop", "matched": last.stop_string or self.ids[k][-1]}   # the stop string, else the token
        if self.echo.logprob:
            meta["output_token_logprobs"] = [self._triple(e) for e in self.entries[k]]
            if self.echo.top:
                meta["output_top_logprobs"] = [[self._triple(t) for t in e.top] for e in self.entries[k]]
            if self.echo.prompt_logprobs and self.prompt_ids[k]:
                given = [self._triple(e) for e in self.prompt_entries[k]]
                first = [[None, self.prompt_ids[k][0], None]] if len(given) < len(self.prompt_ids[k]) else []
                meta["input_token_logprobs"] = first + given
        return {"text": self.text[k], "output_ids": self.ids[k], "meta_info": meta}

    def _rid(self, k: int):
        rid = self.echo.rid
        if isinstance(rid, list) and k < len(rid):
            return rid[k]
        return rid if isinstance(rid, str) else f"{self.request_id}-{k}" if k else self.request_id

    def _triple(self, e) -> list:
        """[logprob, token id, its text or None]: SGLang's; a first prompt token's logprob is None."""
        return [None if math.isnan(e.logprob) else e.logprob, e.token_id,
                token_text(e.token_bytes) if self.echo.text_in_logprobs else None]

    def body(self):
        answers = [self._one(k) for k in range(len(self.text))]
        return answers[0] if self.echo.single else answers

    def frames(self, index: int, chunk: common_pb2.GenerateChunk) -> bytes:
        self.add(index, chunk)
        answer = self._one(index)
        if not self.echo.single:
            answer["index"] = index
        return b"data: " + to_json(answer) + b"\n\n"

    @staticmethod
    def end() -> bytes:
        return b"data: [DONE]\n\n"

    @staticmethod
    def failed(error: ServiceError, param: str | None) -> bytes:
        return b"data: " + to_json({"error": {"message": error.message, "param": param, "code": error.reason}}) + \
            b"\n\n"
