"""The Worker gRPC service: the engine behind one bidirectional Execute stream.

Engine steps run in a single dedicated thread, off the event loop, so health checks and Info stay
responsive while the model computes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, Status, StatusCode

from services.common.cluster_auth import ClusterTrust, no_trust
from services.common.drain import DEFAULT_DRAIN_SECONDS, Drain
from services.common.errors import ErrorKind, ServiceError
from services.common.grpc_server import CHANNEL_OPTIONS, WORKER_SERVER_OPTIONS, run_server
from services.common.metrics import TOKEN_BUCKETS, StateCollector, serve_metrics
from services.common.tracing import (setup_tracing, shutdown_tracing, span_context_from,
                                     tracing_configured)
from services.common.proto.qos.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.wire import answer_prompt_logprobs, answer_tokens
from services.common.step import StepBatch
from services.engine.engine import Engine, EngineConfig, InvalidStepError
from services.engine.kv_tier import KVTier
from services.worker.adapters import WorkerAdapters, adapter_info
from services.worker.cut_ins import CutIns
from services.worker.sequences import PlanError, SequenceTable

log = logging.getLogger(__name__)

UTILIZATION_WINDOW_SECONDS = 5.0
REGISTER_INTERVAL_S = 2.0


class BusyTracker:
    """Share of recent wall time spent in engine steps (the resource monitor's utilization)."""

    def __init__(self, window: float = UTILIZATION_WINDOW_SECONDS):
        self.window = window
        self.spans: deque[tuple[float, float]] = deque()

    def add(self, start: float, end: float) -> None:
        self.spans.append((start, end))

    def utilization(self, now: float) -> float:
        while self.spans and self.spans[0][1] < now - self.window:
            self.spans.popleft()
        busy = sum(end - max(start, now - self.window) for start, end in self.spans)
        return min(1.0, busy / self.window)


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: Engine, drain: Drain, adapter_dirs: Sequence[str] = (),
                 tier: KVTier | None = None):
        self.engine = engine
        self.tier = tier        # its second KV tier: copies the plans carry (StepPlan.tier_*)
        # What copying a block back from the tier costs here, measured before any step.
        self.tier_load_us = tier.measure() * 1e6 if tier is not None else 0.0
        self.drain = drain
        self.table = SequenceTable(engine.kv_spec.block_size, engine.grammars.matcher)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.adapters = WorkerAdapters(engine, self.table, self.executor, adapter_dirs)
        self.cut_ins = CutIns(engine.kv_spec.block_size)
        self.busy = BusyTracker()
        self.stream_open = False
        self.registry = CollectorRegistry()
        self.step_seconds = Histogram("qos_worker_step_seconds", "Engine step wall time",
                                      buckets=TOKEN_BUCKETS + (5.0, 10.0), registry=self.registry)
        self.step_tokens = Counter("qos_worker_tokens_total", "Tokens computed (prefill + decode)",
                                   registry=self.registry)
        self.plan_wait = Histogram("qos_worker_plan_wait_seconds",
                                   "Between two steps with work: from sending an answer to receiving the next plan "
                                   "(the scheduler's turn, transport included)",
                                   buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
                                   registry=self.registry)
        self.registry.register(StateCollector(self._state_metrics))
        self.tracer = setup_tracing("worker")
        self.tracing = tracing_configured()

    def _state_metrics(self):
        yield GaugeMetricFamily("qos_worker_utilization", "Share of recent time spent in steps",
                                value=self.busy.utilization(time.perf_counter()))
        hardware = self.engine.backend.utilization()
        if hardware is not None:
            yield GaugeMetricFamily("qos_worker_device_utilization",
                                    "The device's own busy share (NVML / torch_npu)", value=hardware)
        yield GaugeMetricFamily("qos_worker_active_sequences", "Sequences held", value=len(self.table))
        yield GaugeMetricFamily("qos_worker_kv_blocks", "KV blocks allocated",
                                value=self.engine.kv_spec.num_blocks)
        if self.tier is not None:
            yield GaugeMetricFamily("qos_worker_kv_tier_blocks", "Second KV tier: blocks it holds room for",
                                    value=self.tier.num_slots)
            for name, text, value in [("qos_worker_kv_tier_saved_blocks", "Blocks copied into the tier", self.tier.saved),
                                      ("qos_worker_kv_tier_loaded_blocks", "Blocks copied back into the pool",
                                       self.tier.loaded)]:
                yield CounterMetricFamily(name, text, value=value)

    def info(self) -> worker_pb2.WorkerInfo:
        e = self.engine
        return worker_pb2.WorkerInfo(
            device=str(e.device), device_type=e.device.type, dtype=str(e.dtype).removeprefix("torch."),
            model=Path(e.config.model_dir).name, block_size=e.kv_spec.block_size,
            num_blocks=e.kv_spec.num_blocks, bytes_per_block=e.kv_spec.bytes_per_block,
            max_context=e.max_context, vocab_size=e.model_config.vocab_size,
            eos_token_ids=list(e.model_config.eos_token_ids), active_sequences=len(self.table),
            threads=e.threads, device_name=e.backend.name, draining=self.drain.draining,
            adapters=[adapter_info(a) for a in e.adapters.values()], max_loras=e.adapters.max_loras,
            kv_tier_blocks=self.tier.num_slots if self.tier else 0, kv_tier_load_us_per_block=self.tier_load_us)

    async def Info(self, request, context) -> worker_pb2.WorkerInfo:
        return self.info()

    async def Drain(self, request, context) -> worker_pb2.DrainReply:
        """`qos-serve drain worker ADDR`: drain as on SIGTERM, then exit."""
        log.info("drain requested over gRPC")
        self.drain.request()
        return worker_pb2.DrainReply(active_sequences=len(self.table))

    async def LoadAdapter(self, request: worker_pb2.LoadAdapterRequest, context) -> worker_pb2.LoadAdapterReply:
        return await self.adapters.load(request)

    async def UnloadAdapter(self, request: worker_pb2.UnloadAdapterRequest, context) -> worker_pb2.UnloadAdapterReply:
        return await self.adapters.unload(request)

    async def Execute(self, request_iterator, context):
        """Plans in, answers out, in order, except cut-ins (StepPlan.cut_in): those that arrive while
        a step computes run inside it (services/worker/cut_ins.py) and are answered first."""
        with self.drain.track():       # refused while draining; counted in flight otherwise
            if self.stream_open:
                raise ServiceError(ErrorKind.CONFLICT, "this worker already serves a scheduler "
                                   "(one Execute stream at a time)")
            self.stream_open = True
            loop = asyncio.get_running_loop()
            plans: asyncio.Queue = asyncio.Queue()
            answers: asyncio.Queue = asyncio.Queue()
            reader = asyncio.ensure_future(self._read_plans(request_iterator, plans))
            runner = asyncio.ensure_future(self._run_plans(plans, answers, loop))
            try:
                while (result := await answers.get()) is not None:
                    result.draining = self.drain.draining
                    yield result
                    if result.draining and not self.table:
                        # The scheduler has been told and we hold nothing: the drain is done.
                        log.info("draining: no sequence left; ending the execute stream")
                        return
                await runner         # over: a step that raised ends the stream with its error
            finally:
                reader.cancel()
                runner.cancel()
                # The scheduler went away (or we did): its sequences and block tables mean nothing now.
                self.table.clear()
                self.cut_ins.reset()
                self.stream_open = False
                log.info("execute stream closed; dropped all sequence state")

    async def _read_plans(self, request_iterator, plans: asyncio.Queue) -> None:
        """The scheduler's plans into `plans` (None at the end), but a cut-in the step in flight (or
        the one queued next) takes goes to it: read while the engine computes, so that one can."""
        try:
            async for plan in request_iterator:
                if not plan.cut_in:
                    self.cut_ins.expect()
                elif self.cut_ins.offer(plan):
                    continue
                plans.put_nowait(plan)
        finally:
            plans.put_nowait(None)

    async def _run_plans(self, plans: asyncio.Queue, answers: asyncio.Queue, loop) -> None:
        """Each plan on the engine thread in turn, its answer into `answers` (None at the end);
        the answers of cut-ins run inside a step go there from the engine thread, first."""
        def post(result: worker_pb2.StepResult) -> None:    # from the engine thread
            loop.call_soon_threadsafe(answers.put_nowait, result)
        answered_at = None       # when the last step with work was answered
        try:
            while (plan := await plans.get()) is not None:
                if answered_at is not None and plan.scheduled_seq_ids:
                    self.plan_wait.observe(time.perf_counter() - answered_at)
                answers.put_nowait(await loop.run_in_executor(self.executor, self._run_plan, plan, post))
                answered_at = time.perf_counter() if plan.scheduled_seq_ids else None
        finally:
            answers.put_nowait(None)

    def _run_plan(self, plan: worker_pb2.StepPlan, post) -> worker_pb2.StepResult:
        """Compute the plan (engine thread); the cut-ins offered meanwhile run at its pauses, or
        right after it, each answer handed to `post`. A cut-in that came when no step was open runs
        as a step of its own, which nothing cuts into: it computes first tokens, and a later
        cut-in nested inside it would delay them (it runs right after instead, in arrival order)."""
        if plan.cut_in:
            return self._compute([plan])[0]
        try:
            return self._compute([plan], lambda: self._run_cut_ins(self.cut_ins.take, post))[0]
        finally:
            self.cut_ins.step_over()
            self._run_cut_ins(self.cut_ins.close, post)    # arrived too late to nest: right after

    def _run_cut_ins(self, take, post) -> None:
        """Run the cut-ins `take()` hands over, those that came together as one step, and those
        that arrive meanwhile."""
        while plans := take():
            fitting = []
            for plan in plans:
                try:
                    self.cut_ins.check(plan)
                    fitting.append(plan)
                except PlanError as exc:
                    log.error("cut-in step %d refused: %s", plan.step_id, exc)
                    post(worker_pb2.StepResult(step_id=plan.step_id, error=str(exc)))
            for answer in self._compute(fitting, nested=True) if fitting else ():
                post(answer)

    def _start_step_span(self, plan: worker_pb2.StepPlan, batch):
        """One span per step, child of the first request it serves, linked to every request."""
        contexts = []
        for work in batch.sequences:
            seq = self.table.sequences[work.seq_id]
            if seq.span_context is None and seq.traceparent:
                seq.span_context = span_context_from(seq.traceparent) or False   # parse once
            if seq.span_context:
                contexts.append(seq.span_context)
        parent = trace.set_span_in_context(NonRecordingSpan(contexts[0])) if contexts else None
        return self.tracer.start_span(
            "worker.step", context=parent, links=[Link(c) for c in contexts],
            attributes={"qos.step.id": plan.step_id, "qos.step.sequences": len(batch.sequences),
                        "qos.step.tokens": batch.num_tokens,
                        "qos.step.prefill_tokens": sum(len(w.token_ids) for w in batch.sequences
                                                       if len(w.token_ids) > 1)})

    def _compute(self, plans: list[worker_pb2.StepPlan], pause=None,
                 nested: bool = False) -> list[worker_pb2.StepResult]:
        """Plans on the engine as one step, an answer each: one plan, or cut-ins that arrived
        together (one prefill for all of them). `pause` hosts cut-ins (Engine.step); a `nested`
        step (cut-ins) runs inside another, whose busy time already covers it. A plan that does
        not fit the sequence table is refused alone; a step the engine refuses, every plan in it."""
        started = time.perf_counter()
        answers: dict[int, worker_pb2.StepResult] = {}
        applied = []
        for plan in plans:
            try:
                if plan.tier_block_ids:
                    self._tier_copies(plan)
                applied.append((plan, self.table.apply(plan)))
            except PlanError as exc:
                log.error("step %d refused: %s", plan.step_id, exc)
                answers[plan.step_id] = worker_pb2.StepResult(step_id=plan.step_id, error=str(exc))
        batch = StepBatch([work for _, part in applied for work in part.sequences])
        span = None
        try:
            if self.tracing and batch.sequences:
                span = self._start_step_span(applied[0][0], batch)
            if pause is not None:
                self.cut_ins.host(batch)
            output = self.engine.step(batch, pause) if batch.sequences else None
        except InvalidStepError as exc:
            log.error("step %s refused: %s", ", ".join(str(p.step_id) for p, _ in applied), exc)
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                span.end()
            answers.update((p.step_id, worker_pb2.StepResult(step_id=p.step_id, error=str(exc))) for p, _ in applied)
            return [answers[p.step_id] for p in plans]
        tokens = output.tokens if output else []
        self.table.commit(batch, tokens)
        finished = time.perf_counter()
        if batch.sequences:     # plans that only drop sequences, and heartbeats, are not steps
            if not nested:
                self.busy.add(started, finished)
            self.step_seconds.observe(finished - started)
            self.step_tokens.inc(batch.num_tokens)
        if span is not None:
            span.set_attribute("qos.step.sampled", len(tokens))
            span.end()
        device = self._device_stats(finished)
        by_seq = {token.seq_id: token for token in tokens} if len(applied) > 1 else None
        prompts = output.prompt_logprobs if output else []
        for plan, part in applied:
            mine = tokens if by_seq is None else [by_seq[w.seq_id] for w in part.sequences if w.seq_id in by_seq]
            answer = answer_tokens(
                worker_pb2.StepResult(step_id=plan.step_id, forward_ms=(finished - started) * 1000, device=device),
                mine, plan.packed_results)
            if prompts:
                ids = {w.seq_id for w in part.sequences}
                answer_prompt_logprobs(answer, [p for p in prompts if p.seq_id in ids])
            answers[plan.step_id] = answer
        return [answers[p.step_id] for p in plans]

    def _tier_copies(self, plan: worker_pb2.StepPlan) -> None:
        """The plan's copies between the pool and the tier, in order, before its computing."""
        if self.tier is None:
            raise PlanError(f"step {plan.step_id} copies KV blocks to or from a second tier; this worker has none")
        blocks, slots, loads = plan.tier_block_ids, plan.tier_slots, plan.tier_loads
        try:
            self.tier.check(blocks, slots)
            if len(loads) != len(blocks):
                raise ValueError(f"tier copies: {len(loads)} directions for {len(blocks)} blocks")
        except ValueError as exc:
            raise PlanError(f"step {plan.step_id}: {exc}") from None
        self.tier.copy(blocks, slots, loads)

    def _device_stats(self, now: float) -> worker_pb2.DeviceStats:
        kv_bytes = self.engine.kv_spec.total_bytes
        stats = worker_pb2.DeviceStats(
            memory_used_bytes=kv_bytes, memory_total_bytes=kv_bytes + self.engine.backend.memory().free_bytes,
            utilization=self.busy.utilization(now))
        hardware = self.engine.backend.utilization()
        if hardware is not None:
            stats.device_utilization = hardware
        return stats


def build_engine_config(model_dir: str, worker) -> EngineConfig:
    kv_bytes, kv_fraction = worker.kv_budget()
    return EngineConfig(model_dir=model_dir, device=worker.device, dtype=worker.dtype,
                        block_size=worker.block_size, kv_cache_bytes=kv_bytes,
                        kv_cache_fraction=kv_fraction, num_threads=worker.threads,
                        max_loras=worker.max_loras, max_cpu_loras=worker.max_cpu_loras,
                        decode_attention=worker.decode_attention, prompt_attention=worker.prompt_attention,
                        batch_invariant=worker.batch_invariant)


async def join_pool(scheduler: str, advertised: str, drain: Drain, trust: ClusterTrust) -> None:
    """`--join`: tell the pool's scheduler where we are, again every REGISTER_INTERVAL_S (so a
    scheduler that restarts finds us), until we drain."""
    async with trust.channel(scheduler, "scheduler", CHANNEL_OPTIONS) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        joined = False
        while not drain.draining:
            try:
                reply = await stub.Register(scheduler_pb2.RegisterRequest(address=advertised), timeout=5,
                                            metadata=trust.metadata)
                if not joined:
                    log.info("joined pool %s at scheduler %s as %s", reply.pool, scheduler, advertised)
                joined = True
            except grpc.aio.AioRpcError as exc:
                log.log(logging.WARNING if joined else logging.DEBUG, "registering with %s: %s %s",
                        scheduler, exc.code().name, exc.details())
                joined = False
            await asyncio.sleep(REGISTER_INTERVAL_S)


async def serve_worker(engine: Engine, address: str, metrics_host: str = "127.0.0.1",
                       metrics_port: int | None = None, drain_seconds: float = DEFAULT_DRAIN_SECONDS,
                       join: str | None = None, advertise: str | None = None,
                       trust: ClusterTrust | None = None, adapter_dirs: Sequence[str] = (),
                       tier: KVTier | None = None) -> None:
    """Serve the engine on `address`; with `join`, register with that scheduler as `advertise`
    (default: `address`). `trust`: the cluster token and certificates callers must show, and
    that joining shows (services/common/cluster_auth.py). `adapter_dirs`: the folders adapters
    may be loaded from at run time (services/worker/adapters.py). `tier`: its second KV tier."""
    trust = trust or no_trust("worker")
    service = WorkerService(engine, Drain(f"worker {advertise or address}", drain_seconds), adapter_dirs, tier)
    serve_metrics(service.registry, metrics_host, metrics_port, "worker")
    tasks: list[asyncio.Task] = []

    def register(server: grpc.aio.Server) -> list[str]:
        worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
        return ["qos.v1.Worker"]

    async def started(_port: int) -> None:
        if join:
            tasks.append(asyncio.create_task(join_pool(join, advertise or address, service.drain, trust)))

    async def stopping() -> None:
        for task in tasks:
            task.cancel()

    await run_server("worker", address, register, service.drain, on_started=started,
                     on_stopping=stopping, options=WORKER_SERVER_OPTIONS, trust=trust)
    shutdown_tracing()
    service.executor.shutdown(wait=False, cancel_futures=True)
