"""OpenAI API request bodies (POST /v1/chat/completions and /v1/completions) -> our request.

Pure: JSON bytes in, an `OpenAIRequest` out, or a ServiceError of kind INVALID whose `field` is
the body parameter at fault (OpenAI's `param`). Every field is checked for its type and range; a
field we do not implement is refused by name unless it carries the value that means "off" (so
clients that send defaults, such as `presence_penalty: 0`, still work), never silently ignored.
Parts with a module of their own: the prompt (prompt.py), the class (service_class.py),
what the answer must look like (structured_outputs.py), tools (tools.py).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from services.common.errors import ServiceError, invalid
from services.common.priority import Priority, parse_context_mode
from services.common.proto.qos.v1 import common_pb2, router_pb2
from services.common.step import (LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS,
                                   PENALTY_RANGE)
from services.router.openai_api.json_fields import bool_field, int_field, json_kind, text_field
from services.router.openai_api.service_class import body_class
from services.router.openai_api.prompt import MAX_PROMPTS, parse_prompts, prompt_logprob_sampling, set_prompt
from services.router.openai_api.tools import parse_tools, tool_calls_text
from services.router.openai_api.structured_outputs import FIELDS as STRUCTURED_FIELDS
from services.router.openai_api.structured_outputs import parse_structured
from services.router.openai_api.vllm_options import CHAT_TEMPLATE as VLLM_CHAT_TEMPLATE
from services.router.openai_api.vllm_options import SAMPLING as VLLM_SAMPLING
from services.router.openai_api.vllm_options import parse_vllm_options
from services.router.validation import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, check_cache_salt

CHAT, COMPLETION = "chat", "completion"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
# Keys a message may carry besides role and content, by role (OpenAI's function calling).
MESSAGE_EXTRAS = {"assistant": ("tool_calls",), "tool": ("tool_call_id",)}
MAX_INT32 = 2**31 - 1
COMPLETION_DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions (chat: ours, 256)
MAX_CHOICES = 16                       # n: each choice is a sequence of its own (choices.py)

COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "user", "n",
          "service_tier", "stream", "stream_options",
          "top_k", "ignore_eos", "stop_token_ids", "priority",   # these four as vLLM takes them
          "context_mode",                                 # ours: auto, dense or streaming attention
          *STRUCTURED_FIELDS,                             # response_format, vLLM's (structured_outputs.py)
          "cache_salt", "prompt_cache_key",               # narrow prefix-cache sharing (vLLM, OpenAI)
          "logit_bias", "frequency_penalty", "presence_penalty",
          "repetition_penalty", "min_p", "min_tokens", "prompt_logprobs",    # these five as vLLM takes them
          *VLLM_SAMPLING}                                 # vLLM's (vllm_options.py)
# Identifiers: they never change an answer, so they are only checked to be strings.
HINTS = {"safety_identifier"}
FIELDS = {CHAT: COMMON | HINTS | VLLM_CHAT_TEMPLATE | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                                       "tools", "tool_choice", "parallel_tool_calls"},  # tools.py
          COMPLETION: COMMON | HINTS | {"prompt", "logprobs", "echo"}}
# OpenAI fields we do not implement, with the values that mean "off" (null always does).
NEUTRAL = {
    "tools": ([],), "tool_choice": ("none",),
    "parallel_tool_calls": (True, False), "functions": ([],), "function_call": ("none",),
    "store": (False,), "modalities": (["text"],),
    "best_of": (1,), "echo": (False,), "suffix": ("",),
    "metadata": ({},), "reasoning_effort": (),
    "audio": (), "prediction": (), "web_search_options": (),
    # vLLM's extra parameters at what we do anyway (one sampling path, no beam search): clients
    # written for vLLM send defaults (the ones served: vllm_options.py)
    "use_beam_search": (False,), "length_penalty": (1,), "spaces_between_special_tokens": (True, False),
    # completions: the chat template's options at what they are there (no template)
    "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template_kwargs": ({},),
    "chat_template": (), "documents": (), "mm_processor_kwargs": (), "logits_processors": (), "vllm_xargs": (),
}


@dataclass(slots=True)
class OpenAIRequest:
    kind: str                            # CHAT or COMPLETION
    model: str
    body: router_pb2.GenerateRequest     # prompt or messages, sampling, model: the gRPC request
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False       # vLLM's continuous_usage_stats: every chunk's usage so far
    tier: Priority | None = None         # from service_tier or priority (x-priority must agree)
    tier_field: str = ""                 # which of the two set it (errors name it back)
    user: str = ""
    max_tokens_field: str = "max_tokens"  # which name the client used (errors name it back)
    context_mode: str | None = None      # as sent (the x-context-mode header must agree)
    schema_field: str = ""               # the body field its structured output came from (errors name it)
    tool_mode: str = ""                  # tools: "auto", or a forced call, "required" or "named" (tools.py)
    tool_name: str = ""                  # "named": the function
    n: int = 1                           # choices: requests of their own on the path (choices.py)
    prompts: list = field(default_factory=list)   # completions: each prompt (text or token ids); body has the first
    echo: bool = False                   # completions: the prompt before the answer (prompt.echo_sampling)
    prompt_logprobs: int | None = None   # vLLM's: the prompt tokens' logprobs and this many likeliest
    prompt_only: bool = False            # echo with max_tokens 0: the prompt, and no answer
    tokens_as_ids: bool = False          # vLLM's return_tokens_as_token_ids: logprobs' tokens as "token_id:N"
    token_ids: bool = False              # vLLM's return_token_ids: the prompt's and the answer's ids shown
    responses: object = None             # a Responses API request's ResponsesEcho (responses_request.py)
    tgi: object = None                   # a TGI request's TgiEcho (tgi.py)
    sglang: object = None                # an SGLang /generate request's SglangEcho (sglang.py)

    @property
    def choices(self) -> int:
        """Choices in the answer: n for each prompt (n for a chat)."""
        return self.n * max(1, len(self.prompts))


def parse_rewritten(kind: str, body: dict, names) -> OpenAIRequest:
    """Another API's request rewritten as this body (Responses, TGI, SGLang), parsed: an error
    names the field as that API's body has it (`names.param`)."""
    try:
        return parse_openai(kind, json.dumps(body).encode())
    except ServiceError as error:
        param = names.param(error.field)
        if param != error.field and error.field:
            error.message, error.field = error.message.replace(error.field, param), param
        raise


def renamed_param(chat_param: str, names: dict[str, str | None], prefix: str) -> str | None:
    """A completion's parameter (or an index or field inside it: `stop[0]`) as a rewritten body
    names it: `prefix` + the name in `names` (theirs -> ours; None: not a completion field) whose
    completion field it is; None: none of them."""
    for theirs, ours in names.items():
        if ours and (chat_param == ours or chat_param.startswith(ours + "[")):
            return prefix + theirs + chat_param[len(ours):]
    return None


def parse_openai(kind: str, raw: bytes) -> OpenAIRequest:
    body = json_object(raw)
    for name, value in body.items():
        if name in FIELDS[kind] or value is None:
            continue
        if name in NEUTRAL:
            if not any(_same_json(value, neutral) for neutral in NEUTRAL[name]):
                raise invalid(f"{name} is not supported by this server"
                              + (f" (only {_show(NEUTRAL[name])})" if NEUTRAL[name] else ""), name)
        else:
            raise invalid(f"unknown field {name!r} for {'chat completions' if kind == CHAT else 'completions'}",
                          name)
    request = OpenAIRequest(kind, text_field(_required(body, "model"), "model", allow_empty=False),
                            router_pb2.GenerateRequest())
    request.body.model = request.model
    if kind == CHAT:
        request.body.messages.extend(chat_messages(_required(body, "messages")))
    else:
        request.prompts = parse_prompts(_required(body, "prompt"))
        set_prompt(request.body, request.prompts[0])
        request.echo = body.get("echo") is not None and bool_field(body["echo"], "echo")
    _sampling(body, request)
    _options(body, request)
    parse_vllm_options(body, request, chat=kind == CHAT)
    prompt_logprob_sampling(body, request)
    if kind == CHAT:
        forced_format = request.schema_field
        parse_tools(body, request)
        if forced_format and request.tool_mode in ("named", "required"):
            raise invalid(f"a forced tool call and {forced_format} both say what the answer is: send one",
                          "tool_choice")
    return request


def _same_json(value, expected) -> bool:
    """Equal as JSON values: Python's == has True == 1 and 0 == False, so `best_of: true` and
    `presence_penalty: false` passed as the neutral values they are not."""
    if json_kind(value) != json_kind(expected):
        return False
    if isinstance(value, list):
        return len(value) == len(expected) and all(map(_same_json, value, expected))
    if isinstance(value, dict):
        return value.keys() == expected.keys() and all(_same_json(value[k], expected[k]) for k in value)
    return value == expected


def json_object(raw: bytes) -> dict:
    if not raw.strip():
        raise invalid("the request body is empty: send a JSON object", "body")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise invalid("the request body is nested too deeply", "body") from None
    except ValueError as exc:      # JSON syntax, invalid UTF-8, numbers with too many digits
        raise invalid(f"the request body is not valid JSON: {exc}", "body") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {json_kind(body)}", "body")
    return body


def _show(values: tuple) -> str:
    return " or ".join(json.dumps(v) for v in values)


def _required(body: dict, name: str, field: str | None = None):
    if body.get(name) is None:
        raise invalid(f"{field or name} is required", field or name)
    return body[name]


def _number(value, field: str, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"{field} must be a finite number, got {value if isinstance(value, float) else json_kind(value)}",
                      field)
    if value > high or value < low or (low_open and value == low):
        raise invalid(f"{field} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}",
                      field)
    return float(value)


def chat_messages(value) -> list[common_pb2.ChatMessage]:
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object with role and content", where)
        role = text_field(message.get("role"), f"{where}.role")
        if role not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        allowed = {"role", "content", *MESSAGE_EXTRAS.get(role, ())}
        for key, field_value in message.items():
            # null means absent, as for the body's fields; an assistant turn echoed back from an
            # OpenAI response carries refusal: null and annotations: [] (the client sends them).
            if key not in allowed and field_value is not None and not (key == "annotations" and field_value == []):
                raise invalid(f"{where}.{key} is not supported (a {role} message takes {', '.join(sorted(allowed))})",
                              f"{where}.{key}")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        turn = common_pb2.ChatMessage(role=ROLES[role], content=_content(content, f"{where}.content"))
        if message.get("tool_calls") is not None:
            turn.tool_calls = tool_calls_text(message["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            turn.tool_call_id = text_field(_required(message, "tool_call_id", f"{where}.tool_call_id"),
                                      f"{where}.tool_call_id")
        out.append(turn)
    if not any(m.content or m.tool_calls for m in out):
        raise invalid("messages are all empty", "messages")
    return out


def _content(value, field: str) -> str:
    """A string, or a list of text parts (OpenAI's content-part form) joined together."""
    if isinstance(value, str) or not isinstance(value, list):
        return text_field(value, field)
    texts = []
    for j, part in enumerate(value):
        where = f"{field}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"}:
            raise invalid(f"{where} must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                          "only text is supported", where)
        texts.append(text_field(part["text"], f"{where}.text"))
    return "".join(texts)


def _sampling(body: dict, request: OpenAIRequest) -> None:
    s = request.body.sampling
    limits = [(name, body.get(name)) for name in ("max_tokens", "max_completion_tokens")]
    least = 0 if request.echo else 1        # echo with max_tokens 0: the prompt alone (prompt.py)
    given = [(name, int_field(v, name, least, MAX_INT32)) for name, v in limits if v is not None]
    if len({v for _, v in given}) > 1:
        raise invalid("max_tokens and max_completion_tokens differ: send one of them",
                      "max_completion_tokens")
    if given:
        request.max_tokens_field, s.max_tokens = given[-1]
    elif request.kind == COMPLETION:
        s.max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    if body.get("temperature") is not None:
        s.temperature = _number(body["temperature"], "temperature", 0.0, 2.0)
    if body.get("top_p") is not None:
        s.top_p = _number(body["top_p"], "top_p", 0.0, 1.0, low_open=True)
    if body.get("top_k") is not None:
        s.top_k = max(0, int_field(body["top_k"], "top_k", -1, MAX_INT32))    # vLLM's -1 means off
    if body.get("seed") is not None:
        s.seed = int_field(body["seed"], "seed", 0, 2**64 - 1)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS:
            raise invalid(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
        for i, v in enumerate(stops):
            field = f"stop[{i}]" if isinstance(stop, list) else "stop"
            if len(text_field(v, field, allow_empty=False)) > MAX_STOP_CHARS:
                raise invalid(f"{field} is {len(v)} characters long, at most {MAX_STOP_CHARS} are allowed", field)
            s.stop.append(v)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise invalid(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids",
                          "stop_token_ids")
        s.stop_token_ids.extend(int_field(v, f"stop_token_ids[{i}]", 0, MAX_INT32) for i, v in enumerate(ids))
    if body.get("ignore_eos") is not None:
        s.ignore_eos = bool_field(body["ignore_eos"], "ignore_eos")
    _logprobs(body, request)
    _adjustments(body, s)
    request.schema_field = parse_structured(body, s)


def _adjustments(body: dict, s: common_pb2.SamplingParams) -> None:
    """The logit bias ({"token id": bias}, as OpenAI's), the penalties, min_p and min_tokens, in
    their bounds (services/common/step.py; the scheduler checks the bias's ids against the
    model's vocabulary)."""
    low, high = PENALTY_RANGE
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            setattr(s, name, _number(body[name], name, low, high))
    if body.get("repetition_penalty") is not None:
        s.repetition_penalty = _number(body["repetition_penalty"], "repetition_penalty", 0.0,
                                       MAX_REPETITION_PENALTY, low_open=True)
    if body.get("min_p") is not None:
        s.min_p = _number(body["min_p"], "min_p", 0.0, 1.0)
    if body.get("min_tokens") is not None:      # the scheduler holds it to max_tokens
        s.min_tokens = int_field(body["min_tokens"], "min_tokens", 0, MAX_INT32)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise invalid(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids (as strings) "
                          "to biases", "logit_bias")
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_INT32):
                raise invalid(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            s.logit_bias[int(key)] = _number(value, f"logit_bias[{key}]", *LOGIT_BIAS_RANGE)


def _logprobs(body: dict, request: OpenAIRequest) -> None:
    """Chat: `logprobs: true` and `top_logprobs` (0-20, only with it); completions: `logprobs` N
    (0-20): the chosen token's and the N most likely tokens' log-probabilities."""
    s = request.body.sampling
    if request.kind == COMPLETION:
        if body.get("logprobs") is not None:
            s.logprobs = int_field(body["logprobs"], "logprobs", 0, MAX_TOP_LOGPROBS)
        return
    top = body.get("top_logprobs")
    if body.get("logprobs") is not None and bool_field(body["logprobs"], "logprobs"):
        s.logprobs = 0 if top is None else int_field(top, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    elif top is not None and int_field(top, "top_logprobs", 0, MAX_TOP_LOGPROBS):
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")


def _options(body: dict, request: OpenAIRequest) -> None:
    if body.get("n") is not None:
        request.n = int_field(body["n"], "n", 1, MAX_CHOICES)
    if request.choices > MAX_PROMPTS:
        raise invalid(f"n={request.n} for each of {len(request.prompts)} prompts is {request.choices} "
                      f"choices; at most {MAX_PROMPTS} are served in one request", "n")
    if body.get("stream") is not None:
        request.stream = bool_field(body["stream"], "stream")
    options = body.get("stream_options")
    if options is not None:
        if not request.stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise invalid("stream_options takes include_usage and continuous_usage_stats", "stream_options")
        flags = {name: bool_field(v, f"stream_options.{name}") for name, v in options.items() if v is not None}
        request.include_usage = flags.get("include_usage", False)
        request.continuous_usage = flags.get("continuous_usage_stats", False)
        if request.continuous_usage and not request.include_usage:
            raise invalid("continuous_usage_stats needs include_usage: true", "stream_options.continuous_usage_stats")
    asked = body_class(body)
    if asked:
        request.tier_field, request.tier = asked
    if body.get("user") is not None:
        request.user = text_field(body["user"], "user")
    if body.get("context_mode") is not None:
        request.context_mode = text_field(body["context_mode"], "context_mode").strip().lower()
        try:
            parse_context_mode(request.context_mode, "context_mode")
        except ValueError as exc:
            raise invalid(str(exc), "context_mode") from None
    for hint in HINTS:
        if body.get(hint) is not None:
            text_field(body[hint], hint)
    # vLLM's cache_salt and OpenAI's prompt_cache_key each narrow who shares cached KV with the
    # request (inside its tenant, by default): both given, both must match.
    salts = [check_cache_salt(text_field(body[name], name), name) for name in ("cache_salt", "prompt_cache_key")
             if body.get(name) is not None]
    request.body.cache_salt = "\x1f".join(salts)
