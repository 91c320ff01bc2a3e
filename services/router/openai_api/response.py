"""Our stream chunks -> OpenAI's response objects (one JSON body, or Server-Sent Events), and a
ServiceError -> OpenAI's error body. Pure: dicts in, dicts out; the HTTP front serializes them.

    chat        {"object": "chat.completion", "choices": [{"message": ...}], "usage": ...}
                stream: "chat.completion.chunk" objects; the first delta carries the role, the
                last the finish_reason with an empty delta; with stream_options.include_usage a
                final chunk with no choices carries the usage (and every other has usage null, or
                with vLLM's continuous_usage_stats its choice's tokens so far)
    completion  {"object": "text_completion", "choices": [{"text": ...}]} and chunks alike
"""
from __future__ import annotations

import json

from services.common.errors import ServiceError
from services.common.proto.qos.v1 import common_pb2
from services.common.step import FinishReason
from services.router.openai_api.service_class import TIER_OF
from services.router.openai_api.logprobs import LogprobsView, token_text, vllm_prompt_logprobs
from services.router.openai_api.request import CHAT, OpenAIRequest
from services.router.openai_api.tool_calls import TaggedCalls, ToolCalls


def to_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def finish_label(value: int) -> str | None:
    return FinishReason(value).label if value else None


def stop_reason(chunk: common_pb2.GenerateChunk, stop_token_ids) -> str | int | None:
    """vLLM's stop_reason of a request's last chunk: the stop string that ended it, else the stop
    token (one the request named in stop_token_ids) it ended on; None: the model's EOS, or length."""
    if chunk.stop_string:
        return chunk.stop_string
    last = chunk.token_ids[-1] if chunk.token_ids else None
    if chunk.finish_reason == common_pb2.FINISH_REASON_STOP and last in stop_token_ids:
        return last
    return None


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


class Choice:
    """One choice's state: its text so far, logprobs, tool calls, last chunk."""

    def __init__(self, request: OpenAIRequest, request_id: str, index: int):
        self.index = index
        self.text: list[str] = []
        self.last: common_pb2.GenerateChunk | None = None
        self.sent_role = False
        self.prompt_tokens = self.completion_tokens = 0     # so far: stream_options.continuous_usage_stats
        self.prompt_entries: list[common_pb2.TokenLogprob] = []   # vLLM's prompt_logprobs, from the first chunk
        self.entries: list[common_pb2.TokenLogprob] = []
        # vLLM's return_token_ids: the prompt's ids (the first chunk that carries them) and the answer's
        self.prompt_ids: list[int] | None = None
        self.token_ids: list[int] = []
        # With logprobs asked for: its tokens' entries (common.proto TokenLogprob) made OpenAI's
        self.view = LogprobsView(request.kind == CHAT, request.tokens_as_ids) if request.body.sampling.HasField("logprobs") else None
        self.top = request.body.sampling.logprobs      # most likely tokens an entry shows
        # A completion's echo: its prompt (as text, or token ids whose text the first chunk's
        # prompt entries give), sent before its first text
        self.echo = request.prompts[index // request.n] if request.echo else None
        # Function calling (tool_calls.py): a forced call's text becomes tool_calls; with
        # tool_choice "auto" (a template with a tool format) the calls the model writes are read out.
        forced = request.tool_mode in ("named", "required")
        self.tools = ToolCalls(request.tool_mode, request.tool_name, request_id) if forced else None
        self.tagged = TaggedCalls(request_id) if request.tool_mode == "auto" else None

    def take_ids(self, chunk: common_pb2.GenerateChunk) -> list[int] | None:
        """The prompt's ids the first time a chunk carries them (a pool that took the request
        over sends them again), else None."""
        if self.prompt_ids is None and chunk.prompt_token_ids:
            self.prompt_ids = list(chunk.prompt_token_ids)
            return self.prompt_ids
        return None

    def take_echo(self, chunk: common_pb2.GenerateChunk) -> tuple[str, list[common_pb2.TokenLogprob]]:
        """Once, with the first chunk: the echoed prompt's text and its tokens' entries ("" and
        none without echo, and after)."""
        if self.echo is None:
            return "", []
        prompt, self.echo = self.echo, None
        entries = list(chunk.prompt_logprobs)
        if any(len(e.top) > self.top for e in entries):    # vLLM's prompt_logprobs asked for more of them
            entries = [_cut(e, self.top) for e in entries]
        text = prompt if isinstance(prompt, str) else token_text(b"".join(e.token_bytes for e in entries))
        return text, entries


def _cut(entry: common_pb2.TokenLogprob, k: int) -> common_pb2.TokenLogprob:
    """The entry with its k most likely tokens only."""
    cut = common_pb2.TokenLogprob()
    cut.CopyFrom(entry)
    del cut.top[k:]
    return cut


class OpenAIResponse:
    """The response to one request, of one choice or n (services/router/openai_api/choices.py): its id,
    creation time, model and tier on every object."""

    def __init__(self, request: OpenAIRequest, request_id: str, created: int, priority: int):
        self.request = request
        self.chat = request.kind == CHAT
        self.head = {"id": ("chatcmpl-" if self.chat else "cmpl-") + request_id,
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": created, "model": request.model,
                     "service_tier": TIER_OF[priority], "system_fingerprint": None}
        self.choices = [Choice(request, request_id if i == 0 else f"{request_id}-{i}", i)
                        for i in range(request.choices)]
        self.open = request.choices      # choices without their last chunk yet

    @property
    def finished(self) -> bool:
        return not self.open

    def _last(self, index: int, chunk: common_pb2.GenerateChunk) -> None:
        self.choices[index].last = chunk
        if chunk.finish_reason:
            self.open -= 1

    def usage(self) -> dict:
        """OpenAI's usage: each prompt once (its first choice's, as it is billed), every choice's
        completion."""
        usage = usage_of(self.choices[0].last)
        firsts = [c.last.usage for c in self.choices[::self.request.n]]
        usage["prompt_tokens"] = sum(u.prompt_tokens for u in firsts)
        usage["prompt_tokens_details"]["cached_tokens"] = sum(u.cached_tokens for u in firsts)
        usage["completion_tokens"] = sum(c.last.usage.completion_tokens for c in self.choices)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return usage

    # --- one JSON body ----------------------------------------------------------------------------

    def add(self, index: int, chunk: common_pb2.GenerateChunk) -> None:
        choice = self.choices[index]
        if chunk.prompt_logprobs and self.request.prompt_logprobs is not None:
            choice.prompt_entries = list(chunk.prompt_logprobs)
        echo, entries = choice.take_echo(chunk)
        choice.text.append(echo + chunk.text)
        choice.entries.extend(entries)
        choice.entries.extend(chunk.logprobs)
        choice.take_ids(chunk)
        choice.token_ids.extend(chunk.token_ids)
        self._last(index, chunk)

    def body(self) -> dict:
        """After add() of every chunk, each choice's last (finished) one included."""
        body = {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": [self._whole(c) for c in self.choices], "usage": self.usage()}
        if self.chat and self.request.prompt_logprobs is not None:     # vLLM's: the response's, of its one prompt
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.choices[0].prompt_entries, self.request.prompt_logprobs)
        if self.chat and self.request.token_ids:                       # vLLM's: the response's, of its one prompt
            body["prompt_token_ids"] = self.choices[0].prompt_ids
        return body

    def _whole(self, c: Choice) -> dict:
        text = "".join(c.text)
        choice = ({"index": c.index, "message": {"role": "assistant", "content": text}}
                  if self.chat else {"index": c.index, "text": text})
        if c.tools is not None:
            c.tools.feed(text)
            choice["message"] = {"role": "assistant", "content": None, "tool_calls": c.tools.calls} \
                if c.tools.calls else {"role": "assistant", "content": c.tools.unparsed or None}
        elif c.tagged is not None:
            content, _ = c.tagged.feed(text, final=True)
            if c.tagged.calls:
                choice["message"] = {"role": "assistant", "content": content.strip() or None,
                                     "tool_calls": c.tagged.calls}
        choice.update(finish_reason=self._finish(c, c.last.finish_reason),
                      logprobs=c.view.of(c.entries) if c.view else None,
                      stop_reason=stop_reason(c.last, self.request.body.sampling.stop_token_ids))
        if not self.chat and self.request.prompt_logprobs is not None:    # vLLM's: each choice's prompt
            choice["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_entries, self.request.prompt_logprobs)
        if self.request.token_ids:        # vLLM's: every token sampled (an EOS too); a completion's prompt's
            choice["token_ids"] = c.token_ids
            if not self.chat:
                choice["prompt_token_ids"] = c.prompt_ids
        return choice

    # --- Server-Sent Events -----------------------------------------------------------------------

    def frames(self, index: int, chunk: common_pb2.GenerateChunk) -> bytes:
        """The stream objects for one of our chunks, each a `data:` line."""
        return b"".join(b"data: " + to_json(e) + b"\n\n" for e in self.events(index, chunk))

    @staticmethod
    def end() -> bytes:
        return b"data: [DONE]\n\n"

    @staticmethod
    def failed(error: ServiceError, param: str | None) -> bytes:
        """An error after the stream began: a last `data:` line with OpenAI's error body."""
        return b"data: " + to_json(error_body(error, param)) + b"\n\n"

    def events(self, index: int, chunk: common_pb2.GenerateChunk) -> list[dict]:
        """The stream objects for one of our chunks (several tokens may arrive merged)."""
        out, c = [], self.choices[index]
        self._last(index, chunk)
        c.prompt_tokens = chunk.usage.prompt_tokens or c.prompt_tokens      # on the first chunk and the last
        c.completion_tokens = chunk.usage.completion_tokens if chunk.finish_reason else \
            c.completion_tokens + len(chunk.token_ids)
        if self.chat and not c.sent_role:
            out.append(self._event(c, {"role": "assistant", "content": None if c.tools else ""}))
            c.sent_role = True
        echo, prompt = c.take_echo(chunk)      # completions only (a chat has no echo)
        if chunk.text or echo or (c.view and chunk.logprobs):
            delta = {"content": chunk.text} if self.chat else echo + chunk.text
            if c.tools is not None:
                calls = c.tools.feed(chunk.text)      # none yet while the text is the form's own
                delta = {"tool_calls": calls} if calls else {}
            elif c.tagged is not None:
                content, calls = c.tagged.feed(chunk.text, final=bool(chunk.finish_reason))
                delta = {**({"content": content} if content else {}), **({"tool_calls": calls} if calls else {})}
            if delta or c.view:
                out.append(self._event(c, delta, logprobs=c.view.of([*prompt, *chunk.logprobs]) if c.view else None))
        if chunk.finish_reason:
            if c.tools is not None and c.tools.unparsed:     # cut before a call began: its text
                out.append(self._event(c, {"content": c.tools.unparsed}))
            out.append(self._event(c, {} if self.chat else "", self._finish(c, chunk.finish_reason)))
            out[-1]["choices"][0]["stop_reason"] = stop_reason(chunk, self.request.body.sampling.stop_token_ids)
        if self.request.token_ids:
            self._ids(c, chunk, out)
        if chunk.finish_reason and self.request.include_usage and self.finished:
            out.append({**self.head, "choices": [], "usage": self.usage()})
        return out

    def _ids(self, c: Choice, chunk: common_pb2.GenerateChunk, out: list[dict]) -> None:
        """vLLM's return_token_ids on a stream: the prompt's ids on the choice's first object (a
        chat's at its top), the chunk's tokens on the last object it made, none on the others."""
        prompt = c.take_ids(chunk)
        if not out and (chunk.token_ids or prompt is not None):    # tokens whose text is held back
            out.append(self._event(c, {} if self.chat else ""))
        for event in out:
            event["choices"][0]["token_ids"] = []
        if out:
            out[-1]["choices"][0]["token_ids"] = list(chunk.token_ids)
            if prompt is not None:
                if self.chat:
                    if c.index == 0:          # one prompt: on the response's first object
                        out[0]["prompt_token_ids"] = prompt
                else:
                    out[0]["choices"][0]["prompt_token_ids"] = prompt

    @staticmethod
    def _finish(c: Choice, reason: int) -> str | None:
        """OpenAI's finish_reason: "tool_calls" for a forced call that was completed."""
        label = finish_label(reason)
        called = (c.tools is not None and c.tools.calls) or (c.tagged is not None and c.tagged.calls)
        return "tool_calls" if called and label == "stop" else label

    def _event(self, c: Choice, delta, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": c.index, "delta": delta} if self.chat else {"index": c.index, "text": delta}
        choice.update(finish_reason=finish_reason, logprobs=logprobs)
        event = {**self.head, "choices": [choice]}
        if self.request.continuous_usage:       # vLLM's: this choice's tokens so far
            event["usage"] = {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                              "total_tokens": c.prompt_tokens + c.completion_tokens}
        elif self.request.include_usage:
            event["usage"] = None
        return event


def error_body(error: ServiceError, param: str | None) -> dict:
    """OpenAI's error shape; `code` is our short reason (queue_full, kv_cap, draining, ...). A
    message naming the field as the gRPC request spells it (sampling.max_tokens) names it as the
    client sent it (max_completion_tokens), as `param` does."""
    message = error.message
    if error.field and error.field.startswith(("sampling.", "prompt_token_ids")) and param and param != error.field:
        message = message.replace(error.field, param)
    return {"error": {"message": message, "type": error.kind.status.http_type, "param": param, "code": error.reason}}
