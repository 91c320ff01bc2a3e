"""What an answer must look like, from an OpenAI request body -> the request's sampling.json_schema,
regex, choice or grammar. Pure. At most one of:

    response_format                     OpenAI's: a JSON Schema or any JSON object (response_format.py)
    structured_outputs                  vLLM's: {"json": schema} | {"regex": "..."} |
                                        {"choice": ["...", ...]} | {"grammar": "Lark or GBNF"} |
                                        {"json_object": true}
    guided_json, guided_regex,          the same four as vLLM took them before structured_outputs
    guided_choice, guided_grammar       (it dropped them in 0.12; clients written for it still send them)

Each is compiled here (services/common/grammar.py), before the request goes anywhere: one the
grammar engine cannot compile is a 400 naming the field sent (`structured_outputs.regex`,
`guided_json.properties.age`); the scheduler compiles it again with the model's tokenizer, and
its errors name the same field (generation.http_param, through `schema_field`).
"""
from __future__ import annotations

import json

from services.common.errors import invalid
from services.common.grammar import ANY_OBJECT, check_guide, check_schema
from services.common.proto.qos.v1 import common_pb2
from services.router.openai_api.json_fields import json_kind, text_field
from services.router.openai_api.response_format import json_schema_of

KINDS = ("json", "regex", "choice", "grammar", "json_object")
LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = {"response_format", "structured_outputs", *LEGACY}


def parse_structured(body: dict, s: common_pb2.SamplingParams) -> str:
    """Set the structured output the body asks for on `s`; return the body field it came from
    ("" for none), which errors about it name."""
    asked = _asked(body)
    if len(asked) > 1:
        raise invalid(f"{asked[1][0]} and {asked[0][0]} both say what the answer is: send one of them",
                      asked[1][0])
    if not asked:
        return ""
    where, kind, value = asked[0]
    if kind == "schema_text":
        s.json_schema = value
    elif kind == "json":
        s.json_schema = check_schema(_schema(value, where), where)
    elif kind == "regex":
        s.regex = text_field(value, where, allow_empty=False)
    elif kind == "grammar":
        s.grammar = text_field(value, where, allow_empty=False)
    else:
        if not isinstance(value, list) or not value:
            raise invalid(f"{where} must be a non-empty list of strings", where)
        s.choice.extend(text_field(v, f"{where}[{i}]") for i, v in enumerate(value))
    if kind in ("regex", "grammar", "choice"):
        check_guide(s.regex, s.choice, s.grammar, field=where)
    if s.ignore_eos:
        raise invalid(f"ignore_eos cannot be combined with {where}: a structured answer ends where it is "
                      "complete", "ignore_eos")
    return where


def _asked(body: dict) -> list[tuple[str, str, object]]:
    """(field, kind, value) of each structured output the body asks for."""
    asked = []
    if body.get("response_format") is not None:
        schema = json_schema_of(body["response_format"])      # "" for {"type": "text"}
        if schema:
            asked.append(("response_format.json_schema.schema", "schema_text", schema))
    options = body.get("structured_outputs")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid(f"structured_outputs must be an object with one of {', '.join(KINDS)}",
                          "structured_outputs")
        for key, value in options.items():
            where = f"structured_outputs.{key}"
            if value is None:
                continue
            if key not in KINDS:
                raise invalid(f"{where} is not supported (structured_outputs takes {', '.join(KINDS)})", where)
            if key != "json_object":
                asked.append((where, key, value))
            elif not isinstance(value, bool):
                raise invalid(f"{where} must be true or false, got {json_kind(value)}", where)
            elif value:
                asked.append((where, "schema_text", ANY_OBJECT))
    asked.extend((name, kind, body[name]) for name, kind in LEGACY.items() if body.get(name) is not None)
    return asked


def _schema(value, where: str):
    """A JSON Schema sent as an object, or as JSON text (vLLM takes both)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"{where} is not valid JSON: {exc}", where) from None
