"""Checks of single fields of an OpenAI JSON body, shared by the request's parts (messages,
response_format, tools). Pure: each returns the value or raises INVALID naming the field."""
from __future__ import annotations

import re

from services.common.errors import invalid

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")      # a function's or a response_format schema's name


def json_kind(value) -> str:
    """A value's JSON type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {str: "string", int: "number", float: "number", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


def text_field(value, field: str, allow_empty: bool = True) -> str:
    """A string that protobuf can carry (a lone surrogate from a \\ud800-style escape cannot)."""
    if not isinstance(value, str):
        raise invalid(f"{field} must be a string, got {json_kind(value)}", field)
    if not allow_empty and not value:
        raise invalid(f"{field} must not be empty", field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(f"{field} is not valid Unicode (a lone surrogate at offset {exc.start})",
                      field) from None
    return value


def name_field(value, field: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise invalid(f"{field} must be 1-64 letters, digits, underscores or dashes", field)
    return value


def bool_field(value, field: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(f"{field} must be true or false, got {json_kind(value)}", field)
    return value


def int_field(value, field: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{field} must be an integer, got {json_kind(value)}", field)
    if not low <= value <= high:
        raise invalid(f"{field} must be in {low}..{high}, got {value}", field)
    return value
