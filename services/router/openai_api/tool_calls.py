"""A call's answer as OpenAI's `tool_calls`, whole or streamed as OpenAI streams them. Pure.

The answer is JSON text written under a grammar (tools.py), compact with ", " and ": "
separators, so its shape is known as it arrives:

    named      the arguments object itself: one call, its name known from the start
    required   [{"name": "f", "arguments": {...}}, {"name": "g", "arguments": {...}}]

Streamed, a call's first delta carries its index, id, type and name with empty arguments, the
next ones pieces of its arguments text as they are generated (OpenAI's `tool_calls` deltas); the
arguments are the generated text exactly, never re-serialized. An answer cut (max_tokens) before
its first call's name was complete has no call to show: its text is the message's content
(`unparsed`), not lost behind an empty `tool_calls`.
"""
from __future__ import annotations

NAME_OPEN = '{"name": "'
ARGUMENTS_OPEN = ', "arguments": '


class ToolCalls:
    def __init__(self, mode: str, name: str, request_id: str):
        self.mode, self.request_id = mode, request_id
        self.calls: list[dict] = []
        self._expect = ""              # required: literal text due next
        self._state = "open"           # required: open, name, arguments, close, between
        self._name = ""
        self._depth, self._in_string, self._escaped = 0, False, False
        self._header: list[dict] = []        # named: the call's first delta, sent with the first text
        self._text = ""                      # required: what came before the first call began
        if mode == "named":
            self._state = "arguments"
            self._header.append(self._start(name))

    def feed(self, text: str) -> list[dict]:
        """Delta entries (OpenAI's `delta.tool_calls`) for the next piece of the answer's text."""
        deltas, self._header = self._header, []
        if not self.calls:
            self._text += text
        for char in text:
            self._char(char, deltas)
        return _merged(deltas)

    @property
    def unparsed(self) -> str:
        """The answer's text while no call has begun (a cut answer's content); "" after."""
        return "" if self.calls else self._text

    def _start(self, name: str) -> dict:
        call = {"id": f"call_{self.request_id[:20]}_{len(self.calls)}", "type": "function",
                "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call, "function": dict(call["function"])}

    def _char(self, char: str, deltas: list[dict]) -> None:
        if self._expect:                       # a literal of the fixed form
            self._expect = self._expect[1:]
            return
        if self._state == "arguments":
            self._argument(char, deltas)
            return
        if self._state == "open":              # "["
            self._state, self._expect = "name", NAME_OPEN
        elif self._state == "name":
            if char == '"':                     # names are [A-Za-z0-9_-]: no escapes
                deltas.append(self._start(self._name))
                self._name, self._state, self._expect = "", "arguments", ARGUMENTS_OPEN
            else:
                self._name += char
        elif self._state == "close":            # the call's "}"
            self._state = "between"
        elif self._state == "between":          # ", " then the next call, or "]"
            if char == ",":
                self._state, self._expect = "name", " " + NAME_OPEN

    def _argument(self, char: str, deltas: list[dict]) -> None:
        call = self.calls[-1]
        call["function"]["arguments"] += char
        deltas.append({"index": len(self.calls) - 1, "function": {"arguments": char}})
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 0 and self.mode == "required":
                self._state = "close"


def _merged(deltas: list[dict]) -> list[dict]:
    """Consecutive argument pieces of one call as one delta."""
    out: list[dict] = []
    for delta in deltas:
        last = out[-1] if out else None
        if last is not None and last["index"] == delta["index"] and "id" not in delta and set(delta) == {
                "index", "function"} and set(last["function"]) == {"arguments"}:
            last["function"] = {"arguments": last["function"]["arguments"] + delta["function"]["arguments"]}
        else:
            out.append({**delta, "function": dict(delta["function"])})
    return out


class TaggedCalls:
    """tool_choice "auto" on a model whose chat template has a tool format: the model writes text,
    or calls in the Hermes form its template taught it (Qwen2.5, Hermes, ...),

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    each of which becomes a tool call; the rest stays content. Streamed, text that may begin a
    call's tag is held back until it is known not to, and a call goes out whole once its closing
    tag arrives (its id, name and arguments in one delta)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.calls: list[dict] = []
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content to send, tool_calls deltas) for the next piece of text; `final`: the last."""
        self._held += text
        content, deltas = "", []
        while True:
            start = self._held.find(self.OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._held, self.OPEN)
                content += self._held[:len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                return content, deltas
            end = self._held.find(self.CLOSE, start)
            call = _tagged_call(self._held[start + len(self.OPEN):end]) if end >= 0 else None
            if end < 0 and not final:
                content += self._held[:start]
                self._held = self._held[start:]
                return content, deltas
            if call is None:            # not a call after all (no closing tag, or not JSON): text
                content += self._held[:end + len(self.CLOSE)] if end >= 0 else self._held
                self._held = self._held[end + len(self.CLOSE):] if end >= 0 else ""
                continue
            content += self._held[:start]
            self._held = self._held[end + len(self.CLOSE):]
            entry = {"id": f"call_{self.request_id[:20]}_{len(self.calls)}", "type": "function", "function": call}
            self.calls.append(entry)
            deltas.append({"index": len(self.calls) - 1, **entry})


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def _tagged_call(body: str) -> dict | None:
    import json
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return {"name": call["name"], "arguments": arguments if isinstance(arguments, str)
            else json.dumps(arguments, ensure_ascii=False)}
