"""Our stream chunks -> a Responses API answer (one `response` object, or its stream of typed
events). Pure: the chat answer is made as for /v1/chat/completions (response.py: text,
logprobs, a forced call's arguments, a template's tagged calls) and told in the Responses shape:

    output      a `message` item (its `output_text` part, logprobs when asked) and a
                `function_call` item per call; status "incomplete" with incomplete_details
                {"reason": "max_output_tokens"} when max_output_tokens cut it
    stream      response.created, response.in_progress; per item output_item.added, then
                content_part.added + output_text.delta ... (or function_call_arguments.delta),
                the .done events and output_item.done; last response.completed (or
                response.incomplete) with the whole response. An error after the first event:
                an `error` event, then response.failed. Every event has a sequence_number.
"""
from __future__ import annotations

import copy

from services.common.errors import ServiceError
from services.common.proto.qos.v1 import common_pb2
from services.router.openai_api.service_class import TIER_OF
from services.router.openai_api.request import OpenAIRequest
from services.router.openai_api.response import OpenAIResponse, to_json


class ResponsesAnswer:
    def __init__(self, request: OpenAIRequest, request_id: str, created: int, priority: int):
        self.chat = OpenAIResponse(request, request_id, created, priority)
        self.echo, self.request = request.responses.fields, request.responses
        self.final: dict | None = None         # the response as it ended (what is kept)
        self.id, self.rid = "resp_" + request_id, request_id
        self.created, self.tier, self.model = created, TIER_OF[priority], request.model
        self.sequence = 0
        self.started = False                   # response.in_progress sent
        self.items: list[dict] = []            # the output so far, in order
        self.text: dict | None = None          # the message item being streamed
        self.calls: dict[int, dict] = {}       # a chat tool call's index -> its function_call item
        self.logprobs = request.body.sampling.HasField("logprobs")

    @property
    def finished(self) -> bool:
        return self.chat.finished

    def kept(self) -> tuple[dict, list[dict]] | None:
        """(the response as it ended, its own input items) when it is to be kept."""
        return (self.final, self.request.items) if self.request.store and self.final is not None else None

    def joined(self) -> tuple[str, list[dict]] | None:
        """(its conversation, the items that join it: its input and output) once it has ended with
        an answer (completed or incomplete; a failed one adds nothing)."""
        if self.request.conversation_id is None or self.final is None \
                or self.final["status"] not in ("completed", "incomplete"):
            return None
        return self.request.conversation_id, [*self.request.items, *self.final["output"]]

    def response(self, status: str, usage: dict | None = None, error: dict | None = None) -> dict:
        reason = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": self.request.background, "error": error, "incomplete_details": reason,
                "instructions": self.echo.get("instructions"), "max_output_tokens": self.echo.get("max_output_tokens"),
                "metadata": self.echo.get("metadata", {}), "model": self.model, "output": self.items,
                "parallel_tool_calls": self.echo["parallel_tool_calls"],
                "previous_response_id": self.request.previous_id,
                "conversation": {"id": self.request.conversation_id} if self.request.conversation_id else None,
                "reasoning": {"effort": None, "summary": None}, "service_tier": self.tier, "store": self.request.store,
                "temperature": self.echo.get("temperature"), "text": self.echo["text"],
                "tool_choice": self.echo["tool_choice"], "tools": self.echo["tools"], "top_p": self.echo.get("top_p"),
                "truncation": "disabled", "usage": usage, "user": self.echo.get("user")}

    def usage(self) -> dict:
        chat = self.chat.usage()
        return {"input_tokens": chat["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": chat["total_tokens"]}

    def _status(self) -> str:
        return "incomplete" if self.chat.choices[0].last.finish_reason == common_pb2.FINISH_REASON_LENGTH \
            else "completed"

    # --- one JSON body ----------------------------------------------------------------------------

    def add(self, index: int, chunk: common_pb2.GenerateChunk) -> None:
        self.chat.add(index, chunk)

    def body(self) -> dict:
        choice = self.chat.body()["choices"][0]
        message, status = choice["message"], self._status()
        entries = (choice["logprobs"] or {}).get("content") if self.logprobs else None
        if message.get("content") or not message.get("tool_calls"):
            self._message(status)["content"].append(self._part(message.get("content") or "", entries))
        for k, call in enumerate(message.get("tool_calls") or ()):
            self.items.append(self._call(k, call, status, call["function"]["arguments"]))
        self.final = self.response(status, self.usage())
        return self.final

    def _message(self, status: str) -> dict:
        self.text = {"id": f"msg_{self.rid}", "type": "message", "status": status, "role": "assistant",
                     "content": []}
        self.items.append(self.text)
        return self.text

    def _part(self, text: str, entries: list | None) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        if entries is not None:
            part["logprobs"] = entries
        return part

    def _call(self, k: int, call: dict, status: str, arguments: str) -> dict:
        return {"id": f"fc_{self.rid}_{k}", "type": "function_call", "status": status, "call_id": call["id"],
                "name": call["function"]["name"], "arguments": arguments}

    # --- Server-Sent Events -----------------------------------------------------------------------

    def frames(self, index: int, chunk: common_pb2.GenerateChunk) -> bytes:
        """The events for one of our chunks, framed (`event:` and `data:` lines)."""
        return b"".join(frame(e) for e in self.events(index, chunk))

    def queued(self) -> list[dict]:
        """A background stream's first events, before its first token: created (queued), queued."""
        return [self._event("response.created", response=self.response("queued")),
                self._event("response.queued", response=self.response("queued"))]

    def events(self, index: int, chunk: common_pb2.GenerateChunk) -> list[dict]:
        """The events for one of our chunks."""
        events = []
        if not self.sequence:
            events.append(self._event("response.created", response=self.response("in_progress")))
        if not self.started:
            self.started = True
            events.append(self._event("response.in_progress", response=self.response("in_progress")))
        for chat_event in self.chat.events(index, chunk):
            for choice in chat_event["choices"]:
                events += self._from_chat(choice["delta"], choice["logprobs"])
        if chunk.finish_reason:
            events += self._close(self._status())
            self.final = final = self.response(self._status(), self.usage())
            events.append(self._event("response.incomplete" if final["status"] == "incomplete"
                                      else "response.completed", response=final))
        return events

    def end(self) -> bytes:
        return b""        # the last event (response.completed) says it all: no [DONE] in this API

    def failed(self, error: ServiceError, param: str | None) -> bytes:
        return b"".join(frame(e) for e in self.failed_events(error, param))

    def failed_events(self, error: ServiceError, param: str | None) -> list[dict]:
        if not self.sequence:         # nothing sent yet: the stream opens to say it
            opening = [self._event("response.created", response=self.response("in_progress"))]
        else:
            opening = []
        self.final = self.response("failed", error={"code": error.reason or "server_error", "message": error.message})
        return [*opening, self._event("error", code=error.reason, message=error.message, param=param),
                self._event("response.failed", response=self.final)]

    def ended_events(self, response: dict) -> list[dict]:
        """A background stream's last event when it ended otherwise (cancelled; its router
        stopping): response.failed with the response as it ended."""
        return [self._event("response.failed", response=response)]

    def _event(self, kind: str, **fields) -> dict:
        """An event as things stand now (a copy: the items it shows change as the stream goes on)."""
        event = copy.deepcopy({"type": kind, **fields, "sequence_number": self.sequence})
        self.sequence += 1
        return event

    def _from_chat(self, delta: dict, logprobs: dict | None) -> list[dict]:
        out = []
        entries = (logprobs or {}).get("content") or []
        if delta.get("content") or entries:
            if self.text is None:
                item = self._message("in_progress")
                out += [self._event("response.output_item.added", output_index=len(self.items) - 1,
                                    item={**item, "content": []}),
                        self._event("response.content_part.added", item_id=item["id"],
                                    output_index=len(self.items) - 1, content_index=0,
                                    part=self._part("", None))]
                item["content"].append(self._part("", [] if self.logprobs else None))
            part = self.text["content"][0]
            part["text"] += delta.get("content") or ""
            if self.logprobs:
                part["logprobs"] += entries
            out.append(self._event("response.output_text.delta", item_id=self.text["id"],
                                   output_index=self.items.index(self.text), content_index=0,
                                   delta=delta.get("content") or "", logprobs=entries))
        for call in delta.get("tool_calls") or ():
            item = self.calls.get(call["index"])
            if item is None:
                item = self.calls[call["index"]] = self._call(len(self.calls), call, "in_progress", "")
                self.items.append(item)
                out.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                       item=dict(item)))
            arguments = call["function"].get("arguments") or ""
            if arguments:
                item["arguments"] += arguments
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=self.items.index(item), delta=arguments))
        return out

    def _close(self, status: str) -> list[dict]:
        out = []
        for position, item in enumerate(self.items):
            item["status"] = status
            if item["type"] == "message":
                part = item["content"][0]
                out += [self._event("response.output_text.done", item_id=item["id"], output_index=position,
                                    content_index=0, text=part["text"], logprobs=part.get("logprobs") or []),
                        self._event("response.content_part.done", item_id=item["id"], output_index=position,
                                    content_index=0, part=part)]
            else:
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=position, name=item["name"], arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=position, item=item))
        return out


def frame(event: dict) -> bytes:
    return framed(event["type"], to_json(event))


def framed(kind: str, data: bytes) -> bytes:
    """An event of this type whose JSON is `data`, as the stream sends it."""
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
