"""OpenAI's `response_format` (both HTTP endpoints) -> the request's `sampling.json_schema`. Pure.

    {"type": "text"}                    plain text: nothing asked
    {"type": "json_object"}             any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
                                        JSON valid under the schema

The schema is compiled here, before the request goes anywhere: one the grammar engine cannot
compile is a 400 naming the innermost part at fault (`response_format.json_schema.schema.
properties.age`). The grammar is applied whether or not `strict` is true: an answer always
matches its schema (or ends early at max_tokens, finish_reason "length").
"""
from __future__ import annotations

from services.common.errors import invalid
from services.common.grammar import ANY_OBJECT, check_schema
from services.router.openai_api.json_fields import name_field

FIELD = "response_format"
SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def json_schema_of(value) -> str:
    """The JSON Schema text a response_format asks for ("" for plain text)."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid(f'{FIELD} must be an object with a "type": "text", "json_object" or "json_schema"', FIELD)
    kind = value["type"]
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise invalid(f'{FIELD}.type must be "text", "json_object" or "json_schema", got {kind!r}', f"{FIELD}.type")
    extra = sorted(set(value) - allowed[kind])
    if extra:
        raise invalid(f"{FIELD}.{extra[0]} is not a field of a {kind!r} response_format", f"{FIELD}.{extra[0]}")
    if kind == "text":
        return ""
    if kind == "json_object":
        return ANY_OBJECT
    spec = value.get("json_schema")
    where = f"{FIELD}.json_schema"
    if not isinstance(spec, dict):
        raise invalid(f"{where} must be an object with name and schema", where)
    extra = sorted(set(spec) - SCHEMA_KEYS)
    if extra:
        raise invalid(f"{where}.{extra[0]} is not supported ({where} takes {', '.join(sorted(SCHEMA_KEYS))})",
                      f"{where}.{extra[0]}")
    name_field(spec.get("name"), f"{where}.name")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise invalid(f"{where}.description must be a string", f"{where}.description")   # not sent on
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid(f"{where}.strict must be true or false", f"{where}.strict")
    if spec.get("schema") is None:
        return ANY_OBJECT
    return check_schema(spec["schema"], f"{where}.schema")
