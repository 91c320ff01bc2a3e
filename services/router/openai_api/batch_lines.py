"""OpenAI's Batch API file formats. Pure.

    input    JSONL, a request a line: {"custom_id": unique string, "method": "POST",
             "url": the batch's endpoint, "body": what that endpoint takes (not streamed)}
    output   {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}
             for every line that ran: the output file holds the 200s, the error file the others
             (their body OpenAI's error object) and the lines that never ran (a cancelled or
             expired batch: "response": null, "error": {"code", "message"})
"""
from __future__ import annotations

import json
from dataclasses import dataclass

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_CUSTOM_ID = 512


@dataclass(slots=True, frozen=True)
class BatchLine:
    number: int              # 0-based, as the file has it
    custom_id: str
    body: dict


def read_lines(content: bytes, endpoint: str, max_lines: int) -> tuple[list[BatchLine], list[dict]]:
    """The requests of an input file, and what is wrong with it (OpenAI's batch errors: each with
    a code, a message and its 1-based line); any error fails the whole batch, as OpenAI's do."""
    errors: list[dict] = []
    lines: list[BatchLine] = []
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [_error("invalid_file", f"the file is not UTF-8 (byte {exc.start})", None)]
    raw = text.split("\n")
    while raw and not raw[-1].strip():
        raw.pop()
    if not raw:
        return [], [_error("empty_file", "the file has no request lines", None)]
    if len(raw) > max_lines:
        return [], [_error("too_many_lines", f"the file has {len(raw)} lines; a batch holds at most {max_lines}", None)]
    seen: set[str] = set()
    for number, line in enumerate(raw):
        problem = _check(line, endpoint, seen)
        if isinstance(problem, dict):
            errors.append({**problem, "line": number + 1})
            if len(errors) >= 100:         # enough to fix a file by
                break
        else:
            lines.append(BatchLine(number, *problem))
    return lines, errors


def _check(line: str, endpoint: str, seen: set[str]):
    try:
        item = json.loads(line)
    except (ValueError, RecursionError) as exc:
        return _error("invalid_json_line", f"not a JSON object: {exc}", None)
    if not isinstance(item, dict):
        return _error("invalid_json_line", "not a JSON object", None)
    extra = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if extra:
        return _error("invalid_request", f"unknown field {extra[0]!r} (a line has custom_id, method, url, body)",
                      extra[0])
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return _error("invalid_request", f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters", "custom_id")
    if custom_id in seen:
        return _error("duplicate_custom_id", f"custom_id {custom_id[:80]!r} is on an earlier line too", "custom_id")
    seen.add(custom_id)
    if item.get("method") != "POST":
        return _error("invalid_request", 'method must be "POST"', "method")
    if item.get("url") != endpoint:
        return _error("mismatched_endpoint", f"url must be the batch's endpoint {endpoint}, got "
                      f"{str(item.get('url'))[:80]!r}", "url")
    body = item.get("body")
    if not isinstance(body, dict):
        return _error("invalid_request", "body must be a JSON object (the request)", "body")
    if body.get("stream"):
        return _error("invalid_request", "a batch's requests are not streamed: drop stream", "body.stream")
    return custom_id, body


def _error(code: str, message: str, param: str | None) -> dict:
    return {"code": code, "message": message, "param": param}


def result_line(request_id: str, line: BatchLine, status: int, body: dict) -> str:
    return json.dumps({"id": f"batch_req_{request_id}", "custom_id": line.custom_id,
                       "response": {"status_code": status, "request_id": request_id, "body": body},
                       "error": None}, ensure_ascii=False, separators=(",", ":"))


def unrun_line(batch_id: str, line: BatchLine, code: str, message: str) -> str:
    return json.dumps({"id": f"batch_req_{batch_id}-{line.number}", "custom_id": line.custom_id, "response": None,
                       "error": {"code": code, "message": message}}, ensure_ascii=False, separators=(",", ":"))
