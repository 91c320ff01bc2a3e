"""Our stream chunks -> OpenAI's response objects (one JSON body, or Server-Sent Events), and a
ServiceError -> OpenAI's error body. Pure: dicts in, dicts out; the HTTP front serializes them.

    chat        {"object": "chat.completion", "choices": [{"message": ...}], "usage": ...}
                stream: "chat.completion.chunk" objects; the first delta carries the role, the
                last the finish_reason with an empty delta; with stream_options.include_usage a
                final chunk with no choices carries the usage (and every other has usage null)
    completion  {"object": "text_completion", "choices": [{"text": ...}]} and chunks alike
"""
from __future__ import annotations

from services.common.errors import ServiceError
from services.common.proto.qos.v1 import common_pb2
from services.common.step import FinishReason
from services.router.openai_logprobs import LogprobsView
from services.router.openai_request import CHAT, TIER_OF, OpenAIRequest
from services.router.tool_call_output import TaggedCalls, ToolCalls


def finish_label(value: int) -> str | None:
    return FinishReason(value).label if value else None


def usage_of(chunk: common_pb2.GenerateChunk) -> dict:
    """OpenAI's usage object; `streaming` (ours) when streaming mode served the request: the model
    attended the first sink_tokens and the window_tokens most recent at each token, not the whole."""
    u = chunk.usage
    usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
             "total_tokens": u.prompt_tokens + u.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    if u.HasField("streaming"):
        usage["streaming"] = {"sink_tokens": u.streaming.sink_tokens, "window_tokens": u.streaming.window_tokens}
    return usage


class OpenAIResponse:
    """The response to one request: its id, creation time, model and tier on every object."""

    def __init__(self, request: OpenAIRequest, request_id: str, created: int, priority: int):
        self.request = request
        self.chat = request.kind == CHAT
        self.head = {"id": ("chatcmpl-" if self.chat else "cmpl-") + request_id,
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": created, "model": request.model,
                     "service_tier": TIER_OF[priority], "system_fingerprint": None}
        self.text: list[str] = []
        self.last: common_pb2.GenerateChunk | None = None
        self.sent_role = False
        # With logprobs asked for: each token's entry (common.proto TokenLogprob), made OpenAI's
        self.logprobs = LogprobsView(self.chat) if request.body.sampling.HasField("logprobs") else None
        self.entries: list[common_pb2.TokenLogprob] = []
        # Function calling (tool_call_output.py): a forced call's text becomes tool_calls; with
        # tool_choice "auto" (a template with a tool format) the calls the model writes are read out.
        forced = request.tool_mode in ("named", "required")
        self.tools = ToolCalls(request.tool_mode, request.tool_name, request_id) if forced else None
        self.tagged = TaggedCalls(request_id) if request.tool_mode == "auto" else None

    # --- one JSON body ----------------------------------------------------------------------------

    def add(self, chunk: common_pb2.GenerateChunk) -> None:
        self.text.append(chunk.text)
        self.entries.extend(chunk.logprobs)
        self.last = chunk

    def body(self) -> dict:
        """After add() of every chunk, the last (finished) one included."""
        last, text = self.last, "".join(self.text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}}
                  if self.chat else {"index": 0, "text": text})
        if self.tools is not None:
            self.tools.feed(text)
            choice["message"] = {"role": "assistant", "content": None, "tool_calls": self.tools.calls} \
                if self.tools.calls else {"role": "assistant", "content": self.tools.unparsed or None}
        elif self.tagged is not None:
            content, _ = self.tagged.feed(text, final=True)
            if self.tagged.calls:
                choice["message"] = {"role": "assistant", "content": content.strip() or None,
                                     "tool_calls": self.tagged.calls}
        choice.update(finish_reason=self._finish(last.finish_reason),
                      logprobs=self.logprobs.of(self.entries) if self.logprobs else None)
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": [choice], "usage": usage_of(last)}

    # --- Server-Sent Events -----------------------------------------------------------------------

    def events(self, chunk: common_pb2.GenerateChunk) -> list[dict]:
        """The stream objects for one of our chunks (several tokens may arrive merged)."""
        out = []
        if self.chat and not self.sent_role:
            out.append(self._event({"role": "assistant", "content": None if self.tools else ""}))
            self.sent_role = True
        if chunk.text or (self.logprobs and chunk.logprobs):
            delta = {"content": chunk.text} if self.chat else chunk.text
            if self.tools is not None:
                calls = self.tools.feed(chunk.text)      # none yet while the text is the form's own
                delta = {"tool_calls": calls} if calls else {}
            elif self.tagged is not None:
                content, calls = self.tagged.feed(chunk.text, final=bool(chunk.finish_reason))
                delta = {**({"content": content} if content else {}), **({"tool_calls": calls} if calls else {})}
            if delta or self.logprobs:
                out.append(self._event(delta, logprobs=self.logprobs.of(chunk.logprobs) if self.logprobs else None))
        if chunk.finish_reason:
            if self.tools is not None and self.tools.unparsed:     # cut before a call began: its text
                out.append(self._event({"content": self.tools.unparsed}))
            out.append(self._event({} if self.chat else "", self._finish(chunk.finish_reason)))
            if self.request.include_usage:
                out.append({**self.head, "choices": [], "usage": usage_of(chunk)})
        return out

    def _finish(self, reason: int) -> str | None:
        """OpenAI's finish_reason: "tool_calls" for a forced call that was completed."""
        label = finish_label(reason)
        called = (self.tools is not None and self.tools.calls) or (self.tagged is not None and self.tagged.calls)
        return "tool_calls" if called and label == "stop" else label

    def _event(self, delta, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "delta": delta} if self.chat else {"index": 0, "text": delta}
        choice.update(finish_reason=finish_reason, logprobs=logprobs)
        event = {**self.head, "choices": [choice]}
        if self.request.include_usage:
            event["usage"] = None
        return event


def error_body(error: ServiceError, param: str | None) -> dict:
    """OpenAI's error shape; `code` is our short reason (queue_full, kv_cap, draining, ...). A
    message naming the field as the gRPC request spells it (sampling.max_tokens) names it as the
    client sent it (max_completion_tokens), as `param` does."""
    message = error.message
    if error.field and error.field.startswith("sampling.") and param and param != error.field:
        message = message.replace(error.field, param)
    return {"error": {"message": message, "type": error.kind.status.http_type, "param": param, "code": error.reason}}
