"""Runs OpenAI Batch API jobs in the router, in the background (batch_front.py takes them in).

A router claims a batch in the store with a lease (services/store/batch_store.py) and renews it
while it runs the batch's lines, `[batches] concurrency` at a time, each a request of the batch's
tenant on the shared request path in the class `[batches] priority` (Low by default): routing,
failover and billing are a request's; of the tenant's limits its entitled classes and budget
apply, not its rpm, tpm and max_concurrent, which stay its interactive traffic's (OpenAI keeps
batch limits apart too; this concurrency bounds a batch's load). A line refused for now (a full queue, a rate
limit, no worker: anything that says when to retry) waits and is sent again; any other outcome
is its result, written to the store once. Every line keeps one request id (the batch's id and
the line), so a line run again after a router stopped is not billed twice (the ledger keeps one
row per request id). When every line has its result, or the batch is cancelled or expires, the
runner writes the output and error files and the batch's last status.

A router that drains stops taking lines and lets the ones in flight finish (they are tracked by
the drain); another router, or this one restarted, goes on with the lines left once the lease is
over.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.batch_config import BatchConfig
from services.common.errors import ServiceError
from services.common.priority import MAX_STREAM_INTERVAL, PRIORITY_HEADER
from services.control.tenancy import Caller
from services.router.openai_api.batch_lines import BatchLine, read_lines, result_line, unrun_line
from services.router.openai_api.generation import http_param, whole_answer
from services.router.openai_api.service_class import class_header
from services.router.openai_api.request import CHAT, COMPLETION, parse_openai
from services.router.openai_api.response import error_body
from services.router.openai_api.responses_request import parse_responses
from services.store.batch_store import BatchStore
from services.store.store import Tenant

log = logging.getLogger(__name__)

POLL_S = 1.0                # how often an idle runner looks for a batch (a new batch wakes it at once)
MAX_RETRY_WAIT_S = 60.0     # a retry advice longer than this is waited in pieces (cancel, expiry seen)
PARSERS = {"/v1/chat/completions": lambda raw: parse_openai(CHAT, raw),
           "/v1/completions": lambda raw: parse_openai(COMPLETION, raw),
           "/v1/responses": parse_responses}


class BatchRunner:
    def __init__(self, router, batches: BatchStore, config: BatchConfig, wake: asyncio.Event,
                 registry: CollectorRegistry | None = None):
        self.router, self.store, self.config, self.wake = router, batches, config, wake
        self.replica = router.book.replica
        registry = registry or CollectorRegistry()
        self.lines = Counter("qos_batch_lines", "Batch lines this router finished, by outcome (completed: "
                             "answered 200; failed: another status)", ("outcome",), registry=registry)
        self.running = Gauge("qos_batch_lines_running", "Batch lines this router has in flight", registry=registry)
        self.batches = Counter("qos_batches", "Batches this router ended, by their last status", ("status",),
                               registry=registry)

    async def run(self) -> None:
        store_away = False
        while True:
            batch = None
            if not self.router.drain.draining:
                try:
                    batch = await asyncio.to_thread(self.store.claim, self.replica, time.time(), self.config.lease_s)
                    if store_away:
                        log.warning("batches: the store answers again")
                    store_away = False
                except Exception as exc:      # the store is away: the batches wait for it (said once)
                    if not store_away:
                        log.warning("batches: cannot read the store (%s); batches wait until it answers", exc)
                    store_away = True
            if batch is None:
                self.wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), POLL_S)
                continue
            try:
                await self.run_batch(batch)
            except asyncio.CancelledError:      # the router stops: another may go on with it at once
                with contextlib.suppress(Exception):
                    self.store.release(batch["id"], self.replica)
                raise
            except Exception:
                log.exception("batch %s stopped; it is taken up again shortly", batch["id"])
                await asyncio.sleep(5 * POLL_S)

    async def run_batch(self, batch: dict) -> None:
        content = await asyncio.to_thread(self.store.file_content, None, batch["input_file_id"])
        lines, errors = read_lines(content or b"", batch["endpoint"], self.config.max_lines)
        if errors or content is None:       # its input was deleted since it was checked: what ran stays
            await asyncio.to_thread(self._finish, batch, [], "failed")
            return
        if batch["status"] == "validating":
            await asyncio.to_thread(self.store.set_status, batch["id"], "in_progress", time.time())
        done = await asyncio.to_thread(self.store.done_lines, batch["id"])
        todo = [line for line in lines if line.number not in done]
        caller = Caller(self.router.book.tenants.get(batch["tenant"], Tenant(batch["tenant"])), batch["key_prefix"])
        ending = await self._lines(batch, caller, todo)
        if ending is None:                  # another router holds it now
            return
        await asyncio.to_thread(self.store.set_status, batch["id"], "finalizing", time.time())
        await asyncio.to_thread(self._finish, batch, lines, ending)

    async def _lines(self, batch: dict, caller: Caller, todo: list[BatchLine]) -> str | None:
        """Run the lines; how the batch ends ("completed", "cancelled", "expired"), or None when
        its lease went to another router."""
        status = batch["status"]
        pending = iter(todo)
        running: set[asyncio.Task] = set()
        renew_every = self.config.lease_s / 3
        renewed = time.monotonic()
        try:
            while True:
                stopping = status == "cancelling" or time.time() >= batch["expires_at"] or self.router.drain.draining
                while not stopping and len(running) < self.config.concurrency:
                    line = next(pending, None)
                    if line is None:
                        break
                    running.add(asyncio.create_task(self._line(batch, caller, line)))
                if not running:
                    break
                finished, running = await asyncio.wait(running, timeout=renew_every,
                                                       return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    task.result()       # a bug in a line's run stops the batch here, logged by run()
                if time.monotonic() - renewed >= renew_every:
                    renewed = time.monotonic()
                    status = await asyncio.to_thread(self.store.renew, batch["id"], self.replica, time.time(),
                                                     self.config.lease_s)
                    if status is None:
                        return None
        finally:        # lost the lease, a bug, or the router stops: no line is left running
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        if self.router.drain.draining and next(pending, None) is not None:
            await asyncio.to_thread(self.store.release, batch["id"], self.replica)
            return None
        if status == "cancelling":
            return "cancelled"
        return "expired" if time.time() >= batch["expires_at"] and next(pending, None) is not None else "completed"

    async def _line(self, batch: dict, caller: Caller, line: BatchLine) -> None:
        request_id = f"{batch['id']}-{line.number}"
        request = None
        while True:
            try:
                request = PARSERS[batch["endpoint"]](json.dumps(line.body).encode())
                headers = {PRIORITY_HEADER: self.config.priority}
                class_header(request, headers[PRIORITY_HEADER])          # the body may not ask for another
                head = replace(self.router.let_in(headers, caller), request_id=request_id, batch=True,
                               stream_interval=MAX_STREAM_INTERVAL, prompt_only=request.prompt_only)
                with self.router.drain.track(), self.running.track_inprogress():
                    body = await whole_answer(self.router.path, head, caller, request)
                text, ok = result_line(request_id, line, 200, body), True
            except ServiceError as error:
                if error.retry_after_ms is not None:         # refused for now: nothing ran
                    if self.router.drain.draining or time.time() >= batch["expires_at"]:
                        return      # left for the router that takes the batch over, or expired
                    await asyncio.sleep(min(error.retry_after_ms / 1000, MAX_RETRY_WAIT_S))
                    continue
                text = result_line(request_id, line, error.kind.status.http,
                                   error_body(error, http_param(error.field, request)))
                ok = False
            if await asyncio.to_thread(self.store.record, batch["id"], line.number, ok, text):
                self.lines.labels("completed" if ok else "failed").inc()
            return

    def _finish(self, batch: dict, lines: list[BatchLine], ending: str) -> None:
        """The output and error files from the lines' results, in the input's order, and the lines
        that never ran (a cancelled or expired batch); without the lines (the input is gone), the
        results alone."""
        results = self.store.results(batch["id"])
        output = [text for _, ok, text in results if ok]
        errors = [text for _, ok, text in results if not ok]
        done = {number for number, _, _ in results}
        for line in lines:
            if line.number not in done:
                code = "batch_cancelled" if ending == "cancelled" else "batch_expired"
                errors.append(unrun_line(batch["id"], line, code, f"the batch was {ending} before this request ran"))
        self.store.finish(batch, ending, time.time(), "".join(t + "\n" for t in output).encode(),
                          "".join(t + "\n" for t in errors).encode())
        self.batches.labels(ending).inc()
