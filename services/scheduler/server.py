"""The Scheduler gRPC service: intake (tokenize, check, queue), streaming, pool stats."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.config import SchedulerConfig
from services.common.intake import PriorityIntake
from services.common.grpc_server import run_server
from services.common.metrics import RequestMetrics, StateCollector, serve_metrics
from services.common.percentile import percentile
from services.common.tracing import extract_metadata, setup_tracing, shutdown_tracing, traceparent
from services.common.priority import ORDER, priority_name
from services.common.proto.qos.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.step import SamplingParams
from services.common.tokenizer import TextTokenizer
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.kv_blocks import blocks_for_tokens
from services.scheduler.monitor import ResourceMonitor
from services.scheduler.policy import QoSSettings, create_policy
from services.scheduler.request import Failure, Request
from services.scheduler.worker_link import WorkerLink

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256


def coalesce(event, queue: asyncio.Queue):
    """Merge chunks already waiting behind `event` into it: when this stream falls behind (a busy
    machine), one message carries several tokens instead of one message per token. Returns the
    event to send and a failure taken off the queue meanwhile (to send next), or None. A final
    chunk ends the merge."""
    if isinstance(event, Failure) or event.finish_reason or queue.empty():
        return event, None
    merged = common_pb2.GenerateChunk()
    merged.CopyFrom(event)
    while not queue.empty() and not merged.finish_reason:
        following = queue.get_nowait()
        if isinstance(following, Failure):
            return merged, following
        merged.text += following.text
        merged.token_ids.extend(following.token_ids)
        if following.finish_reason:
            merged.finish_reason = following.finish_reason
            merged.usage.CopyFrom(following.usage)
            merged.timings.CopyFrom(following.timings)
    return merged, None


class RequestRejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, trailers=(), reason: str = ""):
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, tuple(trailers)
        self.reason = reason or code.name.lower()


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerConfig, pool_name: str, model_dir: str,
                 worker_addresses: list[str]):
        self.config = config
        self.pool_name = pool_name
        self.model_name = Path(model_dir).name
        self.tokenizer = TextTokenizer.from_model_dir(model_dir)
        self.links = [WorkerLink(i, address) for i, address in enumerate(worker_addresses)]
        self.policy = create_policy(config.policy, QoSSettings(
            weights=dict(zip(ORDER, map(float, config.weights))),
            kv_caps=dict(zip(ORDER, map(float, config.kv_caps)))))
        self.monitor = ResourceMonitor(self.policy) if self.policy.name == "qos" else None
        self.batcher = ContinuousBatcher(pool_name, self.links, self.policy, config.max_running,
                                         config.max_step_tokens, self.monitor)
        self.rejected: Counter = Counter()
        self.registry = CollectorRegistry()
        self.metrics = RequestMetrics(self.registry, ("priority",))
        self.registry.register(StateCollector(self._state_metrics))
        self.batcher.on_finished = self._record_finished
        self.tracer = setup_tracing("scheduler")
        self.seq_ids = itertools.count(1)
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self.admissions = PriorityIntake(self.admit, self.policy.admits_by_priority)
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.tasks = [asyncio.create_task(link.keep_connected()) for link in self.links]
        self.tasks.append(asyncio.create_task(self.batcher.run()))
        self.tasks.append(asyncio.create_task(self.admissions.run()))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for link in self.links:
            await link.close()
        self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # --- intake ---------------------------------------------------------------------------------

    def _model_limits(self) -> tuple[int, int]:
        """(context window, blocks of the largest worker) from the workers seen so far."""
        infos = [l.info for l in self.links if l.info is not None]
        if not infos:
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE,
                                  "no worker of this pool has connected yet; retry shortly")
        return min(i.max_context for i in infos), max(i.num_blocks for i in infos)

    async def admit(self, submit: scheduler_pb2.SubmitRequest) -> Request:
        """Tokenize in the tokenizer thread (the event loop keeps taking in calls and streaming
        meanwhile), then check the request and build it."""
        if submit.lora:
            raise RequestRejected(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"LoRA adapter {submit.lora!r} requested, but pool {self.pool_name} "
                                  "serves no LoRA adapters")
        self._model_limits()         # no worker yet: refuse before tokenizing
        prompt_ids = await asyncio.get_running_loop().run_in_executor(
            self.tokenizer_thread, self._tokenize, submit)
        return self.intake(submit, prompt_ids)

    def _tokenize(self, submit: scheduler_pb2.SubmitRequest) -> list[int]:
        if submit.messages:
            messages = [{"role": m.role, "content": m.content} for m in submit.messages]
            try:
                prompt_ids = self.tokenizer.encode_chat(messages)
            except ValueError as exc:   # no template, or the template refused the conversation
                raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, f"messages: {exc}") from exc
        else:
            prompt_ids = self.tokenizer.encode(submit.prompt)
        return prompt_ids

    def intake(self, submit: scheduler_pb2.SubmitRequest, prompt_ids: list[int]) -> Request:
        """Admission checks on a tokenized request; RequestRejected says why not."""
        max_context, largest_pool = self._model_limits()
        if not prompt_ids:
            raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty after tokenization")
        if len(prompt_ids) >= max_context:
            raise RequestRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt is {len(prompt_ids)} tokens; the context window is {max_context} tokens "
                "and must leave room for at least one generated token")
        s = submit.sampling
        room = max_context - len(prompt_ids)
        if s.HasField("max_tokens"):
            if s.max_tokens > room:
                raise RequestRejected(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"sampling.max_tokens={s.max_tokens} does not fit: the prompt is {len(prompt_ids)} tokens "
                    f"and the context window {max_context}, leaving {room}")
            max_tokens = s.max_tokens
        else:
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        try:
            sampling = SamplingParams(
                temperature=s.temperature if s.HasField("temperature") else 1.0,
                top_k=s.top_k if s.HasField("top_k") else 0,
                top_p=s.top_p if s.HasField("top_p") else 1.0,
                seed=s.seed if s.HasField("seed") else None,
                max_tokens=max_tokens, stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos)
        except ValueError as exc:
            raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        self._check_capacity(submit, len(prompt_ids), max_tokens, largest_pool)
        return Request(
            request_id=submit.request_id, seq_id=next(self.seq_ids), priority=submit.priority,
            tenant=submit.tenant, prompt_ids=prompt_ids, sampling=sampling,
            detokenizer=IncrementalDetokenizer(self.tokenizer.tokenizer, prompt_ids,
                                               stop=list(s.stop)),
            slo_ms=submit.slo_ms or None)

    def _check_capacity(self, submit, prompt_len: int, max_tokens: int, largest_pool: int) -> None:
        """Admission control: refuse at once what cannot be served (RESOURCE_EXHAUSTED)."""
        priority, name = submit.priority, priority_name(submit.priority)
        retry = [("retry-after-ms", str(self.config.retry_after_ms))]
        need = blocks_for_tokens(prompt_len + max_tokens, self.links[0].info.block_size)
        share = self.policy.kv_cap(priority)
        cap = int(share * largest_pool + 1e-9)
        if need > cap:
            raise RequestRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request needs {need} KV blocks (prompt + max_tokens) but the {name} class may "
                f"hold at most {cap} ({share:.0%} of the largest worker's {largest_pool} blocks of "
                f"pool {self.pool_name})", reason="kv_cap")
        if self.policy.waiting(priority) >= self.config.max_queue:
            raise RequestRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the {name} queue of pool {self.pool_name} is full ({self.config.max_queue} "
                "waiting)", trailers=retry, reason="queue_full")
        if submit.slo_ms:
            wait_ms = self.batcher.estimated_wait_ms(priority, prompt_len)
            if wait_ms > submit.slo_ms:
                raise RequestRejected(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"estimated wait of {wait_ms:.0f} ms for the first token exceeds x-slo-ms="
                    f"{submit.slo_ms}", trailers=retry, reason="slo")

    # --- RPCs -----------------------------------------------------------------------------------

    async def Submit(self, submit: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        span = self.tracer.start_span(
            "scheduler.submit", context=extract_metadata(context.invocation_metadata()),
            kind=SpanKind.SERVER, attributes={
                "qos.request_id": submit.request_id, "qos.priority": priority_name(submit.priority),
                "qos.tenant": submit.tenant, "qos.pool": self.pool_name})
        received, received_ns = time.perf_counter(), time.time_ns()
        try:
            request = await self.admissions.admit(submit, submit.priority)
        except RequestRejected as rejected:
            if rejected.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.rejected[submit.priority] += 1
            self.metrics.rejections.labels(priority_name(submit.priority), rejected.reason).inc()
            span.set_attribute("qos.rejected", rejected.reason)
            span.set_status(Status(StatusCode.ERROR, rejected.message))
            span.end()
            if rejected.trailers:
                context.set_trailing_metadata(rejected.trailers)
            await context.abort(rejected.code, rejected.message)
        # Time spent waiting for admission counts as queueing (timings, TTFT, spans).
        request.arrival, request.arrival_ns = received, received_ns
        request.traceparent = traceparent(trace.set_span_in_context(span))
        span.set_attribute("qos.prompt_tokens", len(request.prompt_ids))
        self.batcher.submit(request)
        outcome = "cancelled"
        try:
            failure_next = None
            while True:
                event, failure_next = coalesce(failure_next or await request.events.get(),
                                               request.events)
                if isinstance(event, Failure):
                    outcome = "failed"
                    span.set_status(Status(StatusCode.ERROR, event.message))
                    if event.trailers:
                        context.set_trailing_metadata(event.trailers)
                    await context.abort(event.code, event.message)
                yield event
                if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    outcome = "completed"
                    return
        finally:
            # Runs when the stream ends for any reason, the client's cancellation included.
            self.batcher.cancel(request)
            self._end_trace(span, request, outcome)

    def _end_trace(self, span, request: Request, outcome: str) -> None:
        """Queue, prefill and decode as child spans of the request's span, from its timestamps."""
        end = request.finished_at or time.perf_counter()
        parent = trace.set_span_in_context(span)
        phases = [("scheduler.queue", request.arrival, request.first_scheduled_at or end),
                  ("scheduler.prefill", request.first_scheduled_at, request.first_token_at or end),
                  ("scheduler.decode", request.first_token_at, end)]
        for name, start, stop in phases:
            if start is not None:
                self.tracer.start_span(name, context=parent, start_time=request.wall_ns(start)) \
                    .end(end_time=request.wall_ns(max(start, stop)))
        span.set_attributes({"qos.output_tokens": len(request.output_ids), "qos.outcome": outcome,
                             "qos.preempted": request.preemptions})
        span.end(end_time=request.wall_ns(end))

    def _record_finished(self, request: Request, now: float) -> None:
        self.metrics.finished((priority_name(request.priority),),
                              request.first_token_at - request.arrival, now - request.arrival,
                              len(request.output_ids))

    def _state_metrics(self):
        b, policy = self.batcher, self.policy
        running, held, weights = b.running_by_priority(), b.kv_blocks_by_priority(), policy.weights()
        gauges = {
            "qos_queue_depth": ("Requests waiting", lambda p: policy.waiting(p)),
            "qos_running": ("Requests holding KV blocks", lambda p: running[p]),
            "qos_kv_blocks": ("KV blocks held", lambda p: held[p]),
            "qos_kv_blocks_peak": ("Most KV blocks held on one worker", lambda p: b.kv_peak[p]),
            "qos_weight": ("Fair-queueing weight", lambda p: weights[p]),
            "qos_kv_cap_share": ("KV cap, share of a worker's blocks", lambda p: policy.kv_cap(p)),
        }
        for name, (text, read) in gauges.items():
            family = GaugeMetricFamily(name, text, labels=["priority"])
            for p in ORDER:
                family.add_metric([priority_name(p)], read(p))
            yield family
        for name, text, values in [("qos_tokens_served", "Prefill + decode tokens computed", b.served_tokens),
                                   ("qos_preemptions", "Sequences preempted", b.preempted_by_priority)]:
            family = CounterMetricFamily(name, text, labels=["priority"])
            for p in ORDER:
                family.add_metric([priority_name(p)], values[p])
            yield family

    def pool_stats(self) -> scheduler_pb2.PoolStats:
        b = self.batcher
        connected = [l for l in self.links if l.is_connected and l.info is not None]
        held = b.kv_blocks_by_priority()
        running = b.running_by_priority()
        preempted = b.preempted_by_priority
        weights = self.policy.weights()
        info = next((l.info for l in self.links if l.info is not None), None)
        return scheduler_pb2.PoolStats(
            pool=self.pool_name, model=self.model_name, policy=self.policy.name,
            device=info.device_type if info else "", workers=len(connected),
            max_context=info.max_context if info else 0,
            block_size=info.block_size if info else 0,
            kv_blocks_total=sum(l.pool.num_blocks for l in connected if l.pool),
            kv_blocks_used=sum(l.pool.num_used for l in connected if l.pool),
            steps=b.steps, preemptions=b.preemptions, ttft_p90_ms=percentile(b.recent_ttft_ms, 0.9),
            utilization=self.monitor.utilization if self.monitor else 0.0,
            classes=[scheduler_pb2.ClassStats(
                priority=p, waiting=self.policy.waiting(p), running=running[p], kv_blocks=held[p],
                output_tokens=b.output_tokens[p], weight=weights[p], kv_cap=self.policy.kv_cap(p),
                served_tokens=b.served_tokens[p], kv_blocks_peak=b.kv_peak[p],
                rejected=self.rejected[p], preempted=preempted[p]) for p in ORDER],
            weight_changes=[scheduler_pb2.WeightChange(
                at_unix_s=c.at, priority=c.priority, old_weight=c.old, new_weight=c.new,
                utilization=c.utilization, free_kv=c.free_kv)
                for c in (self.monitor.changes if self.monitor else ())])

    async def GetPoolStats(self, request, context) -> scheduler_pb2.PoolStats:
        return self.pool_stats()

    async def WatchPoolStats(self, request, context):
        interval = (request.interval_ms or 1000) / 1000
        while True:
            yield self.pool_stats()
            await asyncio.sleep(interval)


async def serve_scheduler(config: SchedulerConfig, pool_name: str, model_dir: str,
                          worker_addresses: list[str]) -> None:
    service = SchedulerService(config, pool_name, model_dir, worker_addresses)

    def register(server: grpc.aio.Server) -> list[str]:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)
        return ["qos.v1.Scheduler"]

    async def started(_port: int) -> None:
        await service.start()

    serve_metrics(service.registry, config.host, config.metrics_port, "scheduler")
    await run_server("scheduler", config.address, register, on_started=started,
                     on_stopping=service.stop)
    shutdown_tracing()
