"""Hugging Face TGI's own API (text-generation-inference), for clients written for it
(huggingface_hub's InferenceClient.text_generation, TGI's Python client, LangChain's
HuggingFaceEndpoint). Pure: a body in, the completion request it means; our chunks out, TGI's
objects.

    POST /generate          {"inputs", "parameters"} -> {"generated_text", "details"?}
    POST /generate_stream   the same, as Server-Sent Events: a `token` object per token, the last
                            with `generated_text` and `details`
    POST /                  TGI's compat route: `stream` in the body picks one of the two
    GET  /info              the model, its context window and the server's bounds

A body is rewritten as the completion it means (`max_new_tokens` -> max_tokens, `grammar` ->
structured_outputs, `truncate` -> truncate_prompt_tokens, `top_n_tokens` -> logprobs, ...) and
read by the completion parser: every check is that endpoint's, and an error names the parameter
as this body has it (`parameters.max_new_tokens`). As TGI: `do_sample` false and no temperature,
top_k or top_p is greedy; a stop sequence that ended the text stays in it (finish_reason
stop_sequence, else eos_token or length). Errors are TGI's {"error", "error_type"} with its
statuses (422 validation, 429 overloaded with Retry-After, 424 generation). With `details`,
`decoder_input_details` gives the input's tokens and their logprobs (`prefill`; not on a stream,
as TGI). `typical_p` is locally typical sampling (services/engine/sampler.py). Refused by name:
best_of above 1, watermark.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.errors import ErrorKind, ServiceError, invalid
from services.common.proto.qos.v1 import common_pb2
from services.common.step import MAX_TOP_LOGPROBS
from services.router.openai_api.json_fields import bool_field, int_field, json_kind, text_field
from services.router.openai_api.logprobs import token_text
from services.router.openai_api.request import COMPLETION, OpenAIRequest, parse_rewritten, renamed_param
from services.router.openai_api.response import to_json

TGI = "tgi"
# TGI's parameter -> the completion field it becomes (None: handled here)
PARAMETERS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
              "seed": "seed", "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
              "stop": "stop", "truncate": "truncate_prompt_tokens", "top_n_tokens": None, "details": None,
              "do_sample": None, "return_full_text": None, "grammar": None, "adapter_id": None, "best_of": None,
              "typical_p": None, "watermark": None, "decoder_input_details": None}
NEUTRAL = {"best_of": (1,), "watermark": (False,)}
GRAMMARS = {"json": "json", "json_object": "json", "regex": "regex"}
STATUS = {ErrorKind.INVALID: (422, "validation"), ErrorKind.EXHAUSTED: (429, "overloaded"),
          ErrorKind.TOO_LARGE: (422, "validation"), ErrorKind.PAYLOAD_TOO_LARGE: (413, "validation")}


@dataclass(slots=True)
class TgiEcho:
    inputs: str
    full_text: bool = False          # return_full_text: the input before the generated text
    details: bool = False
    prefill: bool = False            # decoder_input_details: the input's tokens and logprobs in details
    top_n: int = 0
    seed: int | None = None

    def param(self, chat_param: str | None) -> str | None:
        """A completion's parameter as this body named it."""
        if chat_param is None:
            return None
        if (renamed := renamed_param(chat_param, PARAMETERS, "parameters.")) is not None:
            return renamed
        if chat_param.startswith(("structured_outputs", "response_format")):
            return "parameters.grammar"
        if chat_param in ("prompt", "model"):
            return "inputs" if chat_param == "prompt" else "parameters.adapter_id"
        if chat_param == "logprobs":
            return "parameters.top_n_tokens"
        return chat_param


def parse_tgi(body: dict, model: str, stream: bool | None) -> OpenAIRequest:
    """`stream`: what the route says (None: the body's, TGI's compat route)."""
    extra = sorted(set(body) - {"inputs", "parameters", "stream"})
    if extra:
        raise invalid(f"unknown field {extra[0]!r}: a TGI request has inputs, parameters and stream", extra[0])
    inputs = text_field(body.get("inputs"), "inputs", allow_empty=False)
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise invalid(f"parameters must be an object, got {json_kind(params)}", "parameters")
    for name, value in params.items():
        if name not in PARAMETERS:
            raise invalid(f"parameters.{name} is not a parameter this server knows", f"parameters.{name}")
        if name in NEUTRAL and value is not None and value not in NEUTRAL[name]:
            raise invalid(f"parameters.{name} is not supported by this server (only {NEUTRAL[name][0]!r})",
                          f"parameters.{name}")
    flags = {name: params.get(name) is not None and bool_field(params[name], f"parameters.{name}")
             for name in ("return_full_text", "details", "do_sample", "decoder_input_details")}
    top_n = params.get("top_n_tokens")
    echo = TgiEcho(inputs, full_text=flags["return_full_text"], details=flags["details"],
                   prefill=flags["details"] and flags["decoder_input_details"],
                   top_n=0 if top_n is None else int_field(top_n, "parameters.top_n_tokens", 0, MAX_TOP_LOGPROBS),
                   seed=params.get("seed"))
    completion = {"model": params.get("adapter_id") or model, "prompt": inputs,
                  **{ours: params[tgi] for tgi, ours in PARAMETERS.items() if ours and params.get(tgi) is not None}}
    typical = params.get("typical_p")
    if typical is not None and (isinstance(typical, bool) or not isinstance(typical, (int, float))
                                or not 0 < typical <= 1):
        raise invalid(f"parameters.typical_p must be a number in (0, 1], got {str(typical)[:40]!r}",
                      "parameters.typical_p")
    # as TGI: a warper given (temperature, top_k, top_p, typical_p) samples, do_sample or not
    sampled = flags["do_sample"] or any(params.get(k) is not None
                                        for k in ("temperature", "top_k", "top_p", "typical_p"))
    if not sampled:
        completion["temperature"] = 0
    if completion.get("stop"):
        completion["include_stop_str_in_output"] = True          # TGI keeps the stop sequence
    streaming = body.get("stream") is True if stream is None else stream
    if echo.details or streaming:        # each token's id, text and logprob
        completion["logprobs"] = echo.top_n
    if flags["decoder_input_details"] and streaming:
        raise invalid("parameters.decoder_input_details is not served on a stream (as TGI): use /generate",
                      "parameters.decoder_input_details")
    if echo.prefill:                     # each input token's logprob given those before it
        completion["prompt_logprobs"] = 0
    grammar = params.get("grammar")
    if grammar is not None:
        if not isinstance(grammar, dict) or grammar.get("type") not in GRAMMARS or "value" not in grammar:
            raise invalid('parameters.grammar must be {"type": "json" or "regex", "value": ...}', "parameters.grammar")
        completion["structured_outputs"] = {GRAMMARS[grammar["type"]]: grammar["value"]}
    request = parse_rewritten(COMPLETION, completion, echo)
    if typical is not None:              # (no completion field: the sampling's own)
        request.body.sampling.typical_p = typical
    request.stream, request.tgi = streaming, echo
    return request


def tgi_error(error: ServiceError, param: str | None) -> tuple[int, dict]:
    """TGI's status and error object for one of ours."""
    status, kind = STATUS.get(error.kind, (error.kind.status.http, "generation"))
    message = error.message if not param or not error.field else error.message.replace(error.field, param)
    return status, {"error": message, "error_type": kind}


class TgiAnswer:
    """Our chunks as TGI's answer: one object, or its stream of token events."""

    def __init__(self, request: OpenAIRequest, request_id: str, created: int, priority: int):
        self.echo: TgiEcho = request.tgi
        self.text: list[str] = []
        self.tokens: list[common_pb2.TokenLogprob] = []
        self.prefill: list[common_pb2.TokenLogprob] = []
        self.last: common_pb2.GenerateChunk | None = None
        self.index = 0
        self.prompt_tokens = 0

    @property
    def finished(self) -> bool:
        return self.last is not None and bool(self.last.finish_reason)

    def add(self, index: int, chunk: common_pb2.GenerateChunk) -> None:
        self.text.append(chunk.text)
        self.tokens.extend(chunk.logprobs)
        if self.echo.prefill and chunk.prompt_logprobs and not self.prefill:
            self.prefill = list(chunk.prompt_logprobs)
        self.prompt_tokens = chunk.usage.prompt_tokens or self.prompt_tokens
        self.last = chunk

    def _generated(self) -> str:
        return (self.echo.inputs if self.echo.full_text else "") + "".join(self.text)

    def _finish(self) -> str:
        if self.last.finish_reason == common_pb2.FINISH_REASON_LENGTH:
            return "length"
        return "stop_sequence" if self.last.stop_string else "eos_token"

    def _token(self, entry: common_pb2.TokenLogprob, last: bool) -> dict:
        return {"id": entry.token_id, "text": token_text(entry.token_bytes), "logprob": entry.logprob,
                "special": last and self._finish() == "eos_token"}

    def body(self) -> dict:
        out = {"generated_text": self._generated()}
        if self.echo.details:
            n = len(self.tokens)
            out["details"] = {"finish_reason": self._finish(), "generated_tokens": self.last.usage.completion_tokens,
                              "seed": self.echo.seed, "prefill": [self._input(e) for e in self.prefill],
                              "tokens": [self._token(e, i == n - 1) for i, e in enumerate(self.tokens)],
                              "best_of_sequences": None}
            if self.echo.top_n:
                out["details"]["top_tokens"] = [[self._top(t) for t in e.top] for e in self.tokens]
        return out

    @staticmethod
    def _input(e: common_pb2.TokenLogprob) -> dict:
        """An input token as TGI's prefill lists it: the first one's logprob null."""
        logprob = None if math.isnan(e.logprob) else e.logprob
        return {"id": e.token_id, "text": token_text(e.token_bytes), "logprob": logprob}

    @staticmethod
    def _top(t) -> dict:
        return {"id": t.token_id, "text": token_text(t.token_bytes), "logprob": t.logprob, "special": False}

    def frames(self, index: int, chunk: common_pb2.GenerateChunk) -> bytes:
        """A `data:` event per token of the chunk; the last token's carries the whole text and the
        details when the chunk ends the answer."""
        self.add(index, chunk)
        entries = list(chunk.logprobs)
        events = []
        for k, entry in enumerate(entries):
            self.index += 1
            last = chunk.finish_reason and k == len(entries) - 1
            event = {"index": self.index, "token": self._token(entry, bool(last)), "generated_text": None,
                     "details": None}
            if self.echo.top_n:
                event["top_tokens"] = [self._top(t) for t in entry.top]
            if last:
                event["generated_text"] = self._generated()
                if self.echo.details:        # as TGI's: the stream's details only when asked for
                    event["details"] = {"finish_reason": self._finish(),
                                        "generated_tokens": chunk.usage.completion_tokens,
                                        "seed": self.echo.seed, "input_length": self.prompt_tokens}
            events.append(event)
        return b"".join(b"data:" + to_json(e) + b"\n\n" for e in events)

    @staticmethod
    def end() -> bytes:
        return b""

    @staticmethod
    def failed(error: ServiceError, param: str | None) -> bytes:
        return b"data:" + to_json(tgi_error(error, param)[1]) + b"\n\n"


def tgi_info(model: str, max_context: int, max_body: int) -> dict:
    """GET /info: what TGI's says of the model and the server's bounds (no Docker or Git here)."""
    return {"model_id": model, "model_sha": None, "model_pipeline_tag": "text-generation",
            "max_input_tokens": max_context - 1, "max_total_tokens": max_context, "max_best_of": 1,
            "max_stop_sequences": 64, "max_client_batch_size": 1, "max_concurrent_requests": None,
            "validation_workers": None, "router": "qos-serve", "version": None, "sha": None,
            "docker_label": None, "max_input_length": max_context - 1, "max_batch_total_tokens": None,
            "max_waiting_tokens": None, "max_batch_size": None, "waiting_served_ratio": None,
            "max_request_body_bytes": max_body}
