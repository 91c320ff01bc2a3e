"""One request's way through the router, the same for every front (gRPC and HTTP):

    serve(head, read_body, caller) = let in (key, entitlement, limits) -> admit (priority order)
                                     -> read the body -> route -> relay (-> migrate) -> settle

A front parses what it can cheaply (the RequestHead: priority, tenant, SLO, adapter; the caller
from its API key) and hands over a function that reads and validates the body; everything after
that is here. Failures are ServiceErrors, raised to the front, which maps them to its own statuses.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common.errors import ErrorKind, ServiceError, unavailable
from services.common.grpc_errors import error_from_rpc
from services.common.intake import PriorityIntake
from services.common.proto.qos.v1 import common_pb2, router_pb2, scheduler_pb2
from services.common.tracing import inject_metadata, traceparent
from services.control.accounts import Accounts, billed_prompt
from services.control.limits import estimated_prompt_tokens
from services.control.tenancy import Caller
from services.router.cache_affinity import affinity_key, request_scope
from services.router.pools import PoolDirectory, PoolHandle
from services.router.routing import NoPoolError, RouteRequest
from services.router.scheduler_link import LinkUnsupported
from services.router.tally import RouterTotals, Tally
from services.router.validation import RequestHead

log = logging.getLogger(__name__)

ReadBody = Callable[[int | None], router_pb2.GenerateRequest]   # max context -> validated body


async def _go_ahead(_request) -> None:
    """The router's admission step: nothing to compute, only the turn (priority order) matters."""


class RequestPath:
    def __init__(self, pools: PoolDirectory, totals: RouterTotals, tracer: trace.Tracer,
                 model_name: str, accounts: Accounts, admission: str = "priority",
                 migration_limit: int = 3, scheduler_link: str = "stream", cache_scope: str = "tenant"):
        self.pools = pools
        self.cache_scope = cache_scope            # who shares cached KV: "tenant" or "cluster"
        self.scheduler_link = scheduler_link      # "stream": the pool's link; "calls": a Submit call each
        self.accounts = accounts
        self.migration_limit = migration_limit
        self.totals = totals
        self.tracer = tracer
        self.model_name = model_name
        # Requests go on to validation and their pool in priority order (services/common/intake.py);
        # High at once when no other High request is ahead of it.
        self.admissions = PriorityIntake(_go_ahead, by_priority=admission == "priority",
                                         express_rank=common_pb2.PRIORITY_HIGH)

    async def serve(self, head: RequestHead, read_body: ReadBody, caller: Caller,
                    estimated_tokens: int, parent: Context | None = None,
                    attributes: dict | None = None) -> AsyncIterator[common_pb2.GenerateChunk]:
        span = self.tracer.start_span("router.generate", kind=SpanKind.SERVER, context=parent,
                                      attributes={"qos.request_id": head.request_id, **(attributes or {})})
        try:
            ticket = self.accounts.admit(caller, head, estimated_tokens)
        except ServiceError as refused:
            self.totals.refused_early(refused, head.priority, head.tenant)
            span.set_status(Status(StatusCode.ERROR, refused.message))
            span.end()
            raise
        tally = pool = None
        model = self.model_name
        try:
            await self.admissions.admit(None, head.priority)
            tally = self.totals.start(head.priority, head.tenant, span, head.request_id)
            try:
                body = read_body(self.pools.max_context() if head.context_checked else None)
                model = body.model or model
                if body.model and body.model != self.model_name and not head.lora \
                        and body.model in self.pools.adapter_names():
                    # `model: "ADAPTER"` (OpenAI clients, as vLLM takes it): the base model with it.
                    head = replace(head, lora=body.model)
                    body.model = self.model_name
                pool, predicted = self.route(head, body, span)
                tally.on_routed(pool.name, predicted)
                streamed: list[int] = []        # token ids sent to the client, over every pool
                failed: list[str] = []
                while True:
                    try:
                        async for chunk in self.relay(head, body, pool, tally, span, streamed):
                            streamed.extend(chunk.token_ids)
                            if chunk.finish_reason:     # billed before the client sees it complete
                                await self.accounts.commit_completed(ticket, head, tally,
                                                                     self.pools.specs[pool.name], model)
                            yield chunk
                        self._judge_prediction(tally)
                        return
                    except ServiceError as error:
                        failed.append(pool.name)
                        pool = self._migrate(head, body, span, error, failed, len(streamed))
                        tally.on_migrated(failed[-1], pool.name, error)
            except ServiceError as error:
                tally.on_fail(error)
                raise
        finally:
            self.accounts.settle(ticket, head, tally, self.pools.specs[pool.name] if pool else None, model)
            span.end()

    def _migrate(self, head: RequestHead, body: router_pb2.GenerateRequest, span,
                 error: ServiceError, failed: list[str], streamed: int) -> PoolHandle:
        """The pool that takes over a request whose pool could not continue it (UNAVAILABLE: its
        scheduler died, drains, or has no worker left); raises `error`, saying why, if none may."""
        if error.kind is not ErrorKind.UNAVAILABLE:
            raise error
        if len(failed) > self.migration_limit:
            raise ServiceError(ErrorKind.UNAVAILABLE, f"{error.message}; the request was already moved "
                               f"{self.migration_limit} time(s) (router.migration_limit)",
                               retry_after_ms=error.retry_after_ms, reason=error.reason)
        try:
            pool, _ = self.route(head, body, span, exclude=frozenset(failed))
        except ServiceError as none_left:
            raise ServiceError(ErrorKind.UNAVAILABLE, f"{error.message}; {none_left.message}",
                               retry_after_ms=error.retry_after_ms or 1000, reason=error.reason) from None
        log.warning("request %s: pool %s failed after %d token(s) (%s); continuing on pool %s",
                    head.request_id, failed[-1], streamed, error.message, pool.name)
        return pool

    def _judge_prediction(self, tally: Tally) -> None:
        """A completed request's first token against its pool's prediction: the pool's margin."""
        if tally.predicted_ttft_ms is None or tally.first_token_s is None or tally.outcome != "completed":
            return
        router = self.pools.router
        router.observe_ttft(tally.pool, tally.predicted_ttft_ms, tally.first_token_s * 1000)
        self.totals.prediction_margin.labels(tally.pool).set(router.models[tally.pool].margin)

    def route(self, head: RequestHead, body: router_pb2.GenerateRequest, span,
              exclude: frozenset[str] = frozenset()) -> tuple[PoolHandle, float | None]:
        """The pool for this request, from cached pool stats only, and the time to first token
        its latency model predicts (None before the pool has reported a step)."""
        router = self.pools.router
        route_span = self.tracer.start_span("router.route", context=trace.set_span_in_context(span))
        request = RouteRequest(body.model or self.model_name, head.priority, head.lora,
                               head.slo_ms or None, exclude, estimated_prompt_tokens(body),
                               affinity_key(body.prompt, body.messages, self.scope(head, body), body.prompt_token_ids))
        try:
            decision = router.route(request)
        except NoPoolError as exc:
            route_span.set_status(Status(StatusCode.ERROR, str(exc)))
            route_span.end()
            raise ServiceError(ErrorKind.UNSUPPORTED, str(exc), reason="no_pool",
                               field="x-lora" if head.lora else "model") from None
        predicted = decision.predicted_ttft_ms or router.predict_ttft_ms(decision.pool, request)
        route_span.set_attributes({
            "qos.pool": decision.pool, "qos.route.rule": decision.rule,
            "qos.route.predicted_ttft_ms": predicted if predicted is not None else -1.0,
            "qos.route.threshold": router.threshold.value,
            **{f"qos.route.queued.{n}": l.queued for n, l in router.loads.items()},
            **{f"qos.route.free_kv.{n}": l.free_kv for n, l in router.loads.items()}})
        route_span.end()
        router.note_dispatch(decision.pool, request)
        return self.pools.handles[decision.pool], predicted

    def scope(self, head: RequestHead, body: router_pb2.GenerateRequest) -> str:
        """The request's prefix-cache scope (cache_affinity.request_scope): head.tenant is the
        caller's own when auth is on (the front replaced the header's with the key's)."""
        return request_scope(self.cache_scope, head.tenant, body.cache_salt)

    async def relay(self, head: RequestHead, body: router_pb2.GenerateRequest, pool: PoolHandle,
                    tally: Tally, span, streamed: list[int] = ()) -> AsyncIterator[common_pb2.GenerateChunk]:
        """Submit to the pool's scheduler and stream its chunks back, the cost on the last one;
        after a migration, the pool continues after the `streamed` tokens. On the pool's link
        (services/router/scheduler_link.py) unless the router is set to a Submit call per request
        or the scheduler has no link. A consumer that stops early (the client went away) cancels
        the request at the scheduler."""
        submit = scheduler_pb2.SubmitRequest(
            request_id=head.request_id, priority=head.priority, tenant=head.tenant,
            prompt=body.prompt, messages=body.messages, sampling=body.sampling, slo_ms=head.slo_ms,
            lora=head.lora or "", resume_token_ids=streamed, tenant_weight=head.tenant_weight,
            stream_interval=head.stream_interval, context_mode=head.context_mode,
            cache_scope=self.scope(head, body), tools=body.tools, tool_choice=body.tool_choice,
            prompt_token_ids=body.prompt_token_ids, chat_template=body.chat_template)
        if streamed and submit.sampling.HasField("prompt_logprobs"):
            submit.sampling.ClearField("prompt_logprobs")    # the first chunk, which carries them, went out
        context = trace.set_span_in_context(span)
        spec = self.pools.specs[pool.name]
        on_link = self.scheduler_link == "stream" and not pool.link.unsupported
        while True:
            call = pool.link.submit(submit, traceparent(context)) if on_link else \
                pool.scheduler.Submit(submit, metadata=(*inject_metadata(context), *pool.metadata))
            finished = False
            try:
                async for chunk in call:
                    if head.prompt_only:
                        drop_answer(chunk)
                    tally.on_chunk(chunk)
                    if chunk.finish_reason:
                        finished = True
                        prompt, cached = billed_prompt(head, chunk.usage)
                        chunk.cost_units = self.accounts.amount(
                            spec, head.priority, prompt + chunk.usage.completion_tokens, cached)
                        tally.on_done(chunk)
                    yield chunk
                if not finished:    # the call ended with OK but no last chunk: never leave a client hanging
                    finished = True
                    raise unavailable(f"{pool.peer}: the stream ended without its last chunk", reason="truncated")
                return
            except LinkUnsupported:
                finished = True
                on_link = False     # nothing was sent for it: the same request as a Submit call
            except grpc.aio.AioRpcError as exc:
                finished = True
                raise error_from_rpc(exc, pool.peer) from None
            except ServiceError:    # the link's errors come as the scheduler raised them
                finished = True
                raise
            finally:
                if not finished:
                    tally.on_cancel()
                    call.cancel()


def drop_answer(chunk: common_pb2.GenerateChunk) -> None:
    """An echo with max_tokens 0 (RequestHead.prompt_only): the one token computed after the prompt
    is no part of the answer, shown or billed; the answer ends "length", as one cut at 0 tokens."""
    del chunk.token_ids[:]
    del chunk.logprobs[:]
    chunk.text = ""
    if chunk.finish_reason:
        chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
        chunk.usage.completion_tokens = 0
