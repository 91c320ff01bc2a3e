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
from services.common.step import guides_set

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


# llguidance's lexer work on a matcher's first mask, bounded as on each later one (200,000 units of
# fuel) instead of its default 1,000,000: a step waits for every constrained row's mask, so one
# request's grammar stalls its whole batch, High's rows too. The regex (a{1000}){1000} took 0.95 s
# of a step here under the default and failed anyway; 0.09 s under this. The workers build every
# matcher with it (services/engine/grammar.py) and the scheduler computes each request's first masks
# with it before admitting the request (check_admissible); the JSON schemas and tool calls of
# tests/e2e/test_openai_client_parse.py all fit.
FIRST_MASK_FUEL = 200_000


def check_admissible(sampling, tokenizer) -> None:
    """A structured output compiled and its first two masks computed as a worker does (tokenizer: an
    LLTokenizer; the second after the first token the first allows), within the workers' limits:
    a grammar that exceeds them fails there (llguidance's "too many expressions" comes with the
    second mask of (a{600}){600}, after 0.18 s on the first), so it is INVALID here, naming its
    field, instead of ending in an error after waiting its turn and holding up a step."""
    from llguidance import LLMatcher, LLParserLimits
    field = f"sampling.{guides_set(sampling)[0]}"
    try:
        grammar = grammar_for(sampling)
    except ValueError as exc:
        check_structured(sampling, tokenizer)       # says what is wrong, and where
        raise invalid(f"{field} cannot be compiled into a grammar: {_first_line(str(exc))}", field) from None
    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=LLParserLimits(initial_lexer_fuel=FIRST_MASK_FUEL))
    if matcher.is_error():         # it does not compile for this tokenizer: the precise error
        check_structured(sampling, tokenizer)
    else:
        mask = matcher.compute_bitmask()
        first = next((i for i, byte in enumerate(mask) if byte), None)
        if first is not None and not matcher.is_error():
            matcher.consume_token(8 * first + (mask[first] & -mask[first]).bit_length() - 1)
            if not matcher.is_error() and not matcher.is_stopped():
                matcher.compute_bitmask()
    if matcher.is_error():
        error = matcher.get_error()
        reason = next((line for line in error.splitlines() if line.startswith("Error:")), error.splitlines()[0])
        raise invalid(f"{field} cannot be followed within the engine's limits from its first tokens on (a step "
                      f"does not wait longer on one grammar): {reason.removeprefix('Error: ')[:200]}", field)


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
