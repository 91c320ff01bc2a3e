"""The Scheduler gRPC service: take a request in (tokenize, admission checks, queue), stream its
chunks, report the pool's stats, drain on SIGTERM.

Errors are ServiceErrors (services/common/errors.py), mapped to gRPC statuses by the server's
interceptor; this file never picks a status code.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as MetricCounter

from services.common.cluster_auth import ClusterTrust
from services.common.config import AutoscaleConfig, SchedulerConfig
from services.common.drain import Drain
from services.common.errors import ErrorKind, ServiceError, invalid
from services.common.grpc_server import run_server
from services.common.intake import PriorityIntake
from services.common.metrics import RequestMetrics, StateCollector, serve_metrics
from services.common.priority import HIGH, ORDER, Priority, priority_name
from services.common.proto.qos.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from services.common.step import FinishReason
from services.common.tokenizer import TextTokenizer
from services.common.wire import prompt_chars
from services.common.tracing import TRACEPARENT, extract_metadata, setup_tracing, shutdown_tracing, traceparent
from services.scheduler.admission import Admission, pool_limits
from services.scheduler.long_context import StreamSettings, choose_window
from services.scheduler.request_trace import end_request_trace
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.link_session import LinkSession
from services.scheduler.monitor import ResourceMonitor
from services.scheduler.output import coalesce
from services.scheduler.policy import QoSSettings, create_policy
from services.scheduler.pool_adapters import PoolAdapters
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.prompt_intake import check_allowed, forbidden, tokenized, truncated
from services.scheduler.request import Request, check_token_ids, resume
from services.scheduler.autoscale import ScaleAdvisor
from services.scheduler.tokenizer_threads import TokenizerThreads
from services.scheduler.stats import pool_stats, scale_metrics, scale_signals, state_metrics
from services.scheduler.vllm_metrics import VllmRequestMetrics, lora_info, vllm_gauges
from services.scheduler.membership import Membership
from services.scheduler.worker_link import WorkerLink

log = logging.getLogger(__name__)


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerConfig, pool_name: str, model_dir: str,
                 worker_addresses: list[str], advisor: ScaleAdvisor | None = None,
                 trust: ClusterTrust | None = None):
        self.config = config
        self.pool_name = pool_name
        self.model_name = Path(model_dir).name
        self.tokenizer = TextTokenizer.from_model_dir(model_dir)
        self.worker_addresses = worker_addresses
        self.policy = create_policy(config.policy, QoSSettings(
            weights=dict(zip(ORDER, map(float, config.weights))),
            kv_caps=dict(zip(ORDER, map(float, config.kv_caps))), tenant_fairness=config.tenant_fairness,
            kv_cap_mode=config.kv_cap_mode, high_cut_in=config.high_cut_in,
            high_cut_in_slots=float(config.high_cut_in_slots)))
        self.monitor = ResourceMonitor(self.policy) if self.policy.name == "qos" else None
        self.batcher = ContinuousBatcher(pool_name, [], self.policy, config.max_running,
                                         config.max_step_tokens, self.monitor,
                                         orphan_grace_s=config.orphan_grace_s,
                                         step_timeout_s=config.step_timeout_s,
                                         stream_max_hold_s=config.stream_max_hold_ms / 1000,
                                         prefix_cache=PrefixCache(dict(zip(ORDER, map(float, config.cache_idle_shares))),
                                                                  config.cache_affinity_margin)
                                         if config.prefix_caching else None)
        self.stream_intervals = dict(zip(ORDER, config.stream_intervals))
        self.membership = Membership(self.batcher,
                                     lambda index, address: WorkerLink(index, address, trust, self.batcher.make_pool),
                                     dns_interval_s=config.workers_dns_interval_s)
        self.streaming = StreamSettings.from_config(config)
        self.batcher.planner.stream_chunk = config.stream_chunk_tokens
        self.admission = Admission(pool_name, self.policy.kv_cap, self.policy.waiting,
                                   self.batcher.estimated_wait_ms, config.max_queue, config.retry_after_ms,
                                   self.streaming, self.policy.tenant_waiting if self.policy.tenant_fairness else None)
        self.drain = Drain(f"scheduler of pool {pool_name}", config.drain_seconds)
        self.rejected: Counter = Counter()
        n = len(worker_addresses) or 1
        self.advisor = advisor or ScaleAdvisor(AutoscaleConfig(), n, n)
        self.registry = CollectorRegistry()
        self.metrics = RequestMetrics(self.registry, ("priority",))
        self.stream_chunks = MetricCounter(
            "qos_stream_chunks_total", "Messages sent on request streams (with a stream interval a chunk "
            "carries several tokens)", ("priority",), registry=self.registry)
        self.registry.register(StateCollector(lambda: state_metrics(self.batcher)))
        self.registry.register(StateCollector(lambda: scale_metrics(pool_name, self.batcher, self.advisor)))
        self.vllm_metrics = VllmRequestMetrics(self.registry, self.model_name, pool_name)
        self.registry.register(StateCollector(lambda: vllm_gauges(self.model_name, pool_name, self.batcher)))
        self.registry.register(StateCollector(lambda: lora_info(self.batcher)))
        self.batcher.on_finished = self._record_finished
        self.tracer = setup_tracing("scheduler")
        self.seq_ids = itertools.count(1)
        by_priority = self.policy.admits_by_priority
        self.tokenizer_threads = TokenizerThreads()        # one per class (tokenizer_threads.py)
        self.admissions = PriorityIntake(self.admit, by_priority, express_rank=HIGH)
        self.tasks: list[asyncio.Task] = []
        self.pool_adapters = PoolAdapters(pool_name, self.batcher)

    async def start(self) -> None:
        c = self.config
        self.membership.start(self.worker_addresses if c.workers_from == "config" else [],
                              c.workers_dns if c.workers_from == "dns" else None)
        self.tasks = [asyncio.create_task(self.batcher.run()),
                      asyncio.create_task(self.admissions.run()),
                      asyncio.create_task(self._advise())]

    async def _advise(self) -> None:
        """Once a second: how many workers the pool wants (services/scheduler/autoscale.py), and
        run-time adapters onto workers that joined without them."""
        while True:
            await asyncio.sleep(1.0)
            await self.pool_adapters.sync()
            before = self.advisor.desired
            desired = self.advisor.update(scale_signals(self.batcher, self.config.max_running), time.time())
            if desired != before:
                log.info("pool %s wants %d worker(s), was %d: %s", self.pool_name, desired, before,
                         self.advisor.reason)

    async def stop(self) -> None:
        """After the drain: the loop, the links and the tokenizer threads go."""
        for task in self.tasks:
            task.cancel()
        await self.membership.stop()
        self.tokenizer_threads.shutdown()

    # --- intake ---------------------------------------------------------------------------------

    async def admit(self, submit: scheduler_pb2.SubmitRequest) -> Request:
        """Tokenize (in its class's tokenizer thread: the event loop keeps taking in calls and
        streaming meanwhile; a chat-length High prompt here, tokenizer_threads.py), then check the
        request (services/scheduler/admission.py) and build it."""
        self._limits()         # no worker yet: refuse before tokenizing
        if submit.lora and submit.lora not in self.adapters():
            held = ", ".join(sorted(self.adapters())) or "none"
            raise ServiceError(ErrorKind.UNSUPPORTED, f"LoRA adapter {submit.lora!r} is not loaded in pool "
                               f"{self.pool_name} (its adapters: {held})", field="x-lora", reason="unknown_adapter")
        if self.policy.admits_by_priority and self.tokenizer_threads.inline(submit.priority, prompt_chars(submit)):
            prompt_ids, bad_words = self._tokenize(submit)
        else:
            prompt_ids, bad_words = await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_threads.executor(submit.priority), self._tokenize, submit)
        check_token_ids(submit.sampling.stop_token_ids, self.tokenizer.vocab_size, "sampling.stop_token_ids")
        check_token_ids(sorted(submit.sampling.logit_bias), self.tokenizer.vocab_size, "sampling.logit_bias", keyed=True)
        check_allowed(submit.sampling, self.tokenizer.vocab_size,
                      {i for l in self.batcher.links if l.info is not None for i in l.info.eos_token_ids})
        limits = self._limits()
        prompt_ids = truncated(prompt_ids, submit.sampling, limits.max_context)
        window = choose_window(submit.context_mode, submit.priority, len(prompt_ids), submit.sampling,
                               limits.max_context, limits.block_size, self.streaming)
        if window is not None and submit.sampling.HasField("prompt_logprobs"):
            raise invalid("prompt logprobs (a completion's echo with logprobs) need every prompt token "
                          "attended: not in streaming mode", field="sampling.prompt_logprobs")
        sampling = self.admission.check(submit.priority, prompt_ids, submit.sampling, submit.slo_ms,
                                        limits, window, submit.tenant, submit.tenant_weight or 1.0)
        if bad_words:
            try:
                sampling = replace(sampling, bad_words_ids=bad_words)
            except ValueError as exc:      # SamplingParams names the conflict
                raise invalid(f"sampling.{exc}", field="sampling.bad_words") from exc
        request = Request(
            request_id=submit.request_id, seq_id=next(self.seq_ids), priority=submit.priority,
            tenant=submit.tenant, prompt_ids=prompt_ids, sampling=sampling,
            detokenizer=IncrementalDetokenizer(self.tokenizer.tokenizer, prompt_ids,
                                               stop=list(submit.sampling.stop),
                                               min_tokens=sampling.min_tokens,
                                               skip_special_tokens=submit.sampling.skip_special_tokens
                                               if submit.sampling.HasField("skip_special_tokens") else True,
                                               include_stop=submit.sampling.include_stop_str_in_output),
            slo_ms=submit.slo_ms or None, tenant_weight=submit.tenant_weight or 1.0, lora=submit.lora,
            cache_scope=submit.cache_scope, stream_interval=submit.stream_interval or self.stream_intervals.get(submit.priority, 1),
            window=window, return_prompt_ids=submit.sampling.return_token_ids)
        if submit.resume_token_ids:
            resume(request, list(submit.resume_token_ids), self.tokenizer.vocab_size)
        elif sampling.prompt_logprobs is not None:     # (a resumed request's first chunk went out elsewhere)
            request.prompt_logprobs = {}
        return request

    def adapters(self) -> frozenset[str]:
        return self.pool_adapters.held()

    def _limits(self):
        return pool_limits((l.info for l in self.batcher.links if l.is_connected), self.pool_name)

    def _tokenize(self, submit: scheduler_pb2.SubmitRequest) -> tuple[list[int], tuple]:
        """The prompt's ids and the bad words' (in the tokenizer thread, both)."""
        return tokenized(submit, self.tokenizer, self.model_name), forbidden(submit.sampling, self.tokenizer)

    # --- RPCs -----------------------------------------------------------------------------------

    async def Submit(self, submit: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        stream = self.serve(submit, extract_metadata(context.invocation_metadata()))
        try:
            async for chunk in stream:
                yield chunk
        finally:
            # A call cancelled while its chunk is being written closes this generator, not `serve`
            # (suspended at its yield): closed here, not whenever it is collected.
            await stream.aclose()

    async def SubmitLink(self, requests, context: grpc.aio.ServicerContext):
        """Many requests over one stream (services/scheduler/link_session.py), each served by `serve`."""
        async for reply in LinkSession(self._serve_linked).replies(requests):
            yield reply

    def _serve_linked(self, submit: scheduler_pb2.SubmitRequest, parent_traceparent: str):
        return self.serve(submit, extract_metadata(((TRACEPARENT, parent_traceparent),) if parent_traceparent else ()))

    async def serve(self, submit: scheduler_pb2.SubmitRequest, parent: Context):
        """One request, whichever call it came on: its chunks; a ServiceError when refused or failed.
        `parent`: the trace context the router sent."""
        if self.drain.draining:
            self.metrics.rejections.labels(priority_name(submit.priority), "draining").inc()
        with self.drain.track():      # refused while draining, else counted until it ends
            span = self.tracer.start_span(
                "scheduler.submit", context=parent,
                kind=SpanKind.SERVER, attributes={
                    "qos.request_id": submit.request_id, "qos.priority": priority_name(submit.priority),
                    "qos.tenant": submit.tenant, "qos.pool": self.pool_name})
            received, received_ns = time.perf_counter(), time.time_ns()
            try:
                request = await self.admissions.admit(submit, submit.priority)
            except ServiceError as refused:
                self._count_refusal(submit.priority, refused, span)
                raise
            # Time spent waiting for admission counts as queueing (timings, TTFT, spans).
            request.arrival, request.arrival_ns = received, received_ns
            request.traceparent = traceparent(trace.set_span_in_context(span))
            span.set_attribute("qos.prompt_tokens", len(request.prompt_ids))
            self.batcher.submit(request)
            async for chunk in self._stream(request, span):
                yield chunk

    async def _stream(self, request: Request, span):
        outcome = "cancelled"
        chunks = self.stream_chunks.labels(priority_name(request.priority))
        try:
            failure_next = None
            while True:
                event, failure_next = coalesce(failure_next or await request.events.get(),
                                               request.events)
                if isinstance(event, ServiceError):
                    outcome = "failed"
                    span.set_status(Status(StatusCode.ERROR, event.message))
                    raise event
                chunks.inc()
                yield event
                if event.finish_reason:
                    outcome = "completed"
                    return
        finally:
            # Runs when the stream ends for any reason, the client's cancellation included.
            self.batcher.cancel(request)
            end_request_trace(self.tracer, span, request, outcome)

    def _count_refusal(self, priority: int, refused: ServiceError, span) -> None:
        if refused.kind in (ErrorKind.EXHAUSTED, ErrorKind.TOO_LARGE):
            self.rejected[priority] += 1
        self.metrics.rejections.labels(priority_name(priority), refused.reason).inc()
        span.set_attribute("qos.rejected", refused.reason)
        span.set_status(Status(StatusCode.ERROR, refused.message))
        span.end()

    def _record_finished(self, request: Request, now: float, reason: FinishReason) -> None:
        ttft_s = request.first_token_at - request.arrival
        self.metrics.finished((priority_name(request.priority),), ttft_s, now - request.arrival,
                              len(request.output_ids))
        queue_s = (request.first_scheduled_at or request.first_token_at) - request.arrival
        self.vllm_metrics.finished(priority_name(request.priority), ttft_s, now - request.arrival, queue_s,
                                   len(request.prompt_ids), len(request.output_ids) - request.resumed, reason)
        if request.priority == Priority.HIGH:
            self.advisor.observe_high_ttft(ttft_s * 1000, time.time())

    def pool_stats(self) -> scheduler_pb2.PoolStats:
        return pool_stats(self.pool_name, self.model_name, self.batcher, self.monitor, self.rejected,
                          self.drain.draining, self.advisor)

    async def GetPoolStats(self, request, context) -> scheduler_pb2.PoolStats:
        return self.pool_stats()

    async def Register(self, request: scheduler_pb2.RegisterRequest, context) -> scheduler_pb2.RegisterReply:
        address = request.address.strip()
        host, _, port = address.rpartition(":")
        if not (host and port.isdigit() and 0 < int(port) < 65536):
            raise invalid(f"address must be HOST:PORT, got {request.address!r}", field="address")
        self.drain.check()
        return scheduler_pb2.RegisterReply(pool=self.pool_name, known=self.membership.register(address))

    # --- the model's tokenizer (the router's /tokenize and /detokenize) ---------------------------

    async def Tokenize(self, request: scheduler_pb2.TokenizeRequest, context) -> scheduler_pb2.TokenizeReply:
        """A prompt tokenized as a completion's is, or messages rendered as a chat's are."""
        if bool(request.prompt) == bool(request.messages):
            raise invalid("set one of prompt and messages", field="prompt")
        if request.messages and request.add_special_tokens:
            raise invalid("add_special_tokens is for a prompt: a chat template writes its own", "add_special_tokens")
        ids, strs = await asyncio.to_thread(self._tokenized, request)      # seconds for MiBs: off the loop
        return scheduler_pb2.TokenizeReply(token_ids=ids, max_model_len=self._limits().max_context, token_strs=strs)

    def _tokenized(self, request: scheduler_pb2.TokenizeRequest) -> tuple[list[int], list[str]]:
        if request.add_special_tokens:
            ids = self.tokenizer.encode(request.prompt, True)
        else:
            ids = tokenized(scheduler_pb2.SubmitRequest(prompt=request.prompt, messages=request.messages,
                                                        chat_template=request.chat_template),
                            self.tokenizer, self.model_name)
        return ids, [self.tokenizer.tokenizer.id_to_token(i) for i in ids] if request.return_token_strs else []

    async def Detokenize(self, request: scheduler_pb2.DetokenizeRequest, context) -> scheduler_pb2.DetokenizeReply:
        """Token ids back to text, special tokens included (the inverse of Tokenize, as vLLM's)."""
        check_token_ids(request.token_ids, self.tokenizer.vocab_size, "token_ids")
        text = await asyncio.to_thread(self.tokenizer.decode, list(request.token_ids), False)
        return scheduler_pb2.DetokenizeReply(text=text)

    # --- LoRA adapters at run time (pool_adapters.py) ----------------------------------------------

    async def LoadAdapter(self, request: worker_pb2.LoadAdapterRequest, context) -> scheduler_pb2.AdaptersReply:
        return await self.pool_adapters.load(request.name, request.path)

    async def UnloadAdapter(self, request: worker_pb2.UnloadAdapterRequest, context) -> scheduler_pb2.AdaptersReply:
        return await self.pool_adapters.unload(request.name)

    async def WatchPoolStats(self, request, context):
        interval = (request.interval_ms or 1000) / 1000
        while True:
            yield self.pool_stats()
            await asyncio.sleep(interval)


async def serve_scheduler(config: SchedulerConfig, pool_name: str, model_dir: str,
                          worker_addresses: list[str], advisor: ScaleAdvisor | None = None,
                          trust: ClusterTrust | None = None) -> None:
    service = SchedulerService(config, pool_name, model_dir, worker_addresses, advisor, trust)

    def register(server: grpc.aio.Server) -> list[str]:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)
        return ["qos.v1.Scheduler"]

    async def started(_port: int) -> None:
        await service.start()

    serve_metrics(service.registry, config.host, config.metrics_port, "scheduler")
    await run_server("scheduler", config.address, register, service.drain, on_started=started,
                     on_stopping=service.stop, trust=trust)
    shutdown_tracing()
