"""Structured outputs: a JSON Schema, a regular expression, a list of choices or a context-free
grammar as the grammar its answers must follow (llguidance).

Pure Python over llguidance's Rust library (no torch), so every hop compiles a request's schema:
the router and the scheduler to refuse one that cannot be served at once, naming the part at fault
(`check_schema`), the worker to build the matcher that masks each sampled token
(services/engine/grammar.py). All of them compile the same JSON text with the same options.

Answers are compact JSON with `", "` and `": "` separators, no other whitespace: a model left free
to add whitespace may emit it for ever (a known failure of constrained decoding), and one fixed
form is what the tool-call parser reads. JSON Schema `format`s, `pattern`s, enums, bounds, `$ref`s
and `anyOf` are honoured as llguidance implements them; a keyword it does not implement is an
error, never silently ignored.
"""
from __future__ import annotations

import json

from services.common.errors import invalid

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'           # json_object mode: any JSON object
# Where a schema nests others, by keyword: a schema itself, a list of them, or a map to them.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


MAX_GUIDE_CHARS = 65_536      # a regex's or a grammar's text, all choices together
MAX_CHOICES = 1_024           # strings a choice may list


def grammar_of(schema_text: str) -> str:
    """llguidance's grammar (JSON text) for a JSON Schema given as JSON text."""
    from llguidance import LLMatcher
    return LLMatcher.grammar_from_json_schema(schema_text, overrides=JSON_OPTIONS)


def guide_grammar(regex: str = "", choice=(), grammar: str = "") -> str:
    """llguidance's grammar for the one of these that is set (its JSON form, or Lark text: its
    matchers take either): a regular expression, strings the answer is exactly one of, a
    context-free grammar in Lark or GBNF. Raises ValueError with the converter's message for a
    GBNF grammar it cannot read."""
    from llguidance import LLMatcher
    if regex:
        return LLMatcher.grammar_from_regex(regex)
    if choice:      # JSON's string escapes are Lark's
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choice))
    from llguidance.gbnf_to_lark import any_to_lark
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(grammar))
    except Exception as exc:     # the converter raises Exception itself for a rule it cannot find
        raise ValueError(str(exc)) from None


def grammar_for(sampling) -> str:
    """The llguidance grammar of a constrained sampling (SamplingParams or either proto)."""
    if sampling.json_schema:
        return grammar_of(sampling.json_schema)
    return guide_grammar(sampling.regex, tuple(sampling.choice), sampling.grammar)


def check_guide(regex: str, choice, grammar: str, field: str = "", tokenizer=None) -> None:
    """A regex, choice list or grammar the engine can compile (with `tokenizer`, an LLTokenizer,
    down to its tokens); else an INVALID error naming `field` (default: `sampling.regex`, ...)."""
    choice = list(choice)
    field = field or f"sampling.{'regex' if regex else 'choice' if choice else 'grammar'}"
    if len(choice) > MAX_CHOICES:
        raise invalid(f"{field} lists {len(choice)} strings; at most {MAX_CHOICES} are allowed", field)
    size = len(regex) + sum(map(len, choice)) + len(grammar)
    if size > MAX_GUIDE_CHARS:
        raise invalid(f"{field} is {size} characters long; at most {MAX_GUIDE_CHARS} are allowed", field)
    from llguidance import LLMatcher
    try:
        error = LLMatcher.validate_grammar(guide_grammar(regex, choice, grammar), tokenizer)
    except ValueError as exc:
        error = str(exc)
    if error and not error.startswith("WARNING"):
        raise invalid(f"{field} cannot be compiled into a grammar: {_first_line(error)}", field)


def check_structured(sampling, tokenizer=None) -> None:
    """A client's sampling's structured output (json_schema, or regex / choice / grammar), if it
    has one, compiled as every hop compiles it: INVALID naming `sampling.<kind>` when it cannot be."""
    if sampling.json_schema:
        check_schema_text(sampling.json_schema, "sampling.json_schema", tokenizer)
    elif sampling.regex or sampling.choice or sampling.grammar:
        check_guide(sampling.regex, sampling.choice, sampling.grammar, tokenizer=tokenizer)


def compile_error(schema_text: str, tokenizer=None) -> str:
    """Why llguidance cannot compile the schema ("" when it can); with `tokenizer` (an
    LLTokenizer) the token-level part too."""
    from llguidance import LLMatcher
    try:
        grammar = grammar_of(schema_text)
    except ValueError as exc:
        return str(exc)
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    return "" if error.startswith("WARNING") else error


def check_schema(schema, field: str, tokenizer=None) -> str:
    """A schema (parsed JSON) the engine can compile, as the JSON text every hop compiles; else an
    INVALID error naming the innermost part that does not compile (`field.properties.age`)."""
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"{field} must be a JSON Schema (an object), got {type(schema).__name__}", field)
    # ASCII escapes: the text goes on the wire as a protobuf string, which a lone surrogate breaks.
    text = json.dumps(schema, separators=(",", ":"))
    error = compile_error(text, tokenizer)
    if error:
        where, error = _culprit(schema, field, error)
        raise invalid(f"{where} cannot be compiled into a grammar: {_first_line(error)}", where)
    return text


def check_schema_text(text: str, field: str, tokenizer=None) -> str:
    """check_schema of a schema sent as JSON text (over gRPC)."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"{field} is not valid JSON: {exc}", field) from None
    return check_schema(schema, field, tokenizer)


def _culprit(schema, field: str, error: str, definitions: dict | None = None) -> tuple[str, str]:
    """The innermost subschema that fails to compile on its own (with the root's definitions, so
    that its $refs resolve), and its error; the whole schema when no part fails alone."""
    if not isinstance(schema, dict):
        return field, error
    if definitions is None:
        definitions = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    for path, part in _parts(schema):
        if isinstance(part, dict):
            part_error = compile_error(json.dumps({**definitions, **part}, separators=(",", ":")))
            if part_error:
                return _culprit(part, f"{field}.{path}", part_error, definitions)
    return field, error


def _parts(schema: dict):
    """(path, subschema) of each schema directly inside `schema`."""
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield key, schema[key]
    for key in _LIST:
        if isinstance(schema.get(key), list):
            yield from ((f"{key}[{i}]", part) for i, part in enumerate(schema[key]))
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            yield from ((f"{key}.{name}", part) for name, part in schema[key].items())


def _first_line(error: str) -> str:
    """llguidance's message on one line (a regex error spans several), at most 300 characters."""
    text = " ".join(line.strip() for line in error.strip().splitlines() if line.strip())
    return (text[:297] + "...") if len(text) > 300 else text or "unknown error"
