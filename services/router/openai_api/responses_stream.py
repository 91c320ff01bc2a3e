"""A background response made with `stream: true`: its events go to the client that made it as
they come, and are kept, so a client whose connection dropped resumes from the last event it read
on any router replica (OpenAI's background streaming):

    GET /v1/responses/{id}?stream=true[&starting_after=N]     the events after sequence number N

The router running it holds its events in memory (an EventLog: its own readers follow it there)
and writes them to the store (response_events) every FLUSH_S, and all of them before the
response's last status, so a reader elsewhere reads them from the store, asking again every
POLL_S, until the last event. The last event is response.completed, response.incomplete or
response.failed (also for a response cancelled, or whose router stopped: the response as it
ended); for one whose router was lost, a reader sends response.failed with it as the store says
it ended. Events are kept `[responses] stream_events_s` (an hour), then deleted.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from services.router.openai_api.responses_output import frame, framed
from services.store.response_store import ACTIVE, ResponseStore

log = logging.getLogger(__name__)

FLUSH_S = 0.2          # a running stream's events reach the store at most this late (and all at its end)
POLL_S = 0.2           # a reader on another replica asks the store again this often
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


class EventLog:
    """A running background stream's events in order (an event's index is its sequence number),
    what of them the store has, and its readers here waiting for the next."""

    def __init__(self, response_id: str):
        self.response_id = response_id
        self.events: list[dict] = []
        self.stored = 0                       # events[:stored] are in the store
        self.stored_at = time.monotonic()
        self.done = False
        self._more = asyncio.Event()

    def extend(self, events: list[dict]) -> None:
        self.events += events
        self._more.set()
        self._more = asyncio.Event()

    def close(self) -> None:
        self.done = True
        self._more.set()

    @property
    def ended(self) -> bool:
        return bool(self.events) and self.events[-1]["type"] in TERMINAL

    async def tail(self, after: int) -> AsyncIterator[bytes]:
        """The events after sequence number `after`, framed, as they come, to the last."""
        k = after + 1
        while True:
            while k < len(self.events):
                yield frame(self.events[k])
                k += 1
            if self.done:
                return
            await self._more.wait()

    async def store(self, store: ResponseStore, everything: bool = False) -> None:
        """The events not yet in the store written there (when FLUSH_S passed, or `everything`);
        a store that does not take them is asked again at the next."""
        if self.stored == len(self.events) or not (everything or time.monotonic() - self.stored_at >= FLUSH_S):
            return
        rows = [(event["sequence_number"], json.dumps(event)) for event in self.events[self.stored:]]
        try:
            await asyncio.to_thread(store.add_events, self.response_id, rows, time.time())
        except Exception as exc:          # its readers here still get them; elsewhere, at the next write
            log.warning("could not keep events of background response %s (%s)", self.response_id, exc)
            return
        self.stored, self.stored_at = self.stored + len(rows), time.monotonic()


async def stored_tail(store: ResponseStore, response_id: str, after: int) -> AsyncIterator[bytes]:
    """The events after `after` from the store, asking again every POLL_S until the last; a
    response that ended without one (its router was lost) ends with response.failed, the
    response as the store says it ended."""
    seen = after
    while True:
        rows = await asyncio.to_thread(store.events, response_id, seen)
        for seq, text in rows:
            seen, kind = seq, json.loads(text)["type"]
            yield framed(kind, text.encode())
            if kind in TERMINAL:
                return
        if rows:
            continue
        response = await asyncio.to_thread(store.current, response_id, time.time())
        if response is None:              # deleted, or expired, meanwhile
            return
        if response["status"] not in ACTIVE:
            # Its events were written before its last status: all are there. One asked past its
            # last event has no more; one that has none last (its router was lost) gets it now.
            last = await asyncio.to_thread(store.last_event, response_id)
            if last is not None and last[0] > seen:
                continue
            if last is None or last[1] not in TERMINAL:
                yield frame({"type": "response.failed", "response": response,
                             "sequence_number": max(seen, -1 if last is None else last[0]) + 1})
            return
        await asyncio.sleep(POLL_S)
