"""A pool of the cluster simulator driven by the real scheduler: services/scheduler's
ContinuousBatcher plans every step (WFQ, caps, admission, preemption, chunked prefill) and
postprocesses every sampled token, exactly as in a running pool; only the worker is simulated:
its step takes the accelerator's step time (bench/sim/accelerators.py) for the tokens the plan
computes and the KV tokens it holds, and samples token 7 for every sequence that reached the end
of its known tokens.

High cut-ins as the batcher sends them (services/scheduler/cut_in_dispatch.py): a High request
arriving while a step without first tokens computes is planned by the real planner's plan_cut_in
and runs inside that step (the step in flight pauses for it: its end moves by the cut-in's step
time); its token comes when the cut-in's own step ends. So the pool's next event is the end of
its step or of a cut-in (next_event; step_end handles whichever is due).

Exact, and slow (the planner's Python per step): for small clusters and for checking
bench/sim/fast_pool.py (bench/simulate.py --validate).
"""
from __future__ import annotations

import heapq

from bench.sim.accelerators import BLOCK_TOKENS, Accelerator
from bench.sim.pool_base import PoolBase
from bench.sim.workload import SimRequest
from services.common.config import SchedulerConfig
from services.common.kv_blocks import KVBlockPool
from services.common.priority import HIGH, ORDER
from services.common.proto.qos.v1 import worker_pb2
from services.common.step import FinishReason, SampledToken, SamplingParams
from services.common.wire import answer_tokens, sampled_tokens
from services.scheduler.batcher import ContinuousBatcher
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.policy import QoSSettings, create_policy
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.request import Request
from services.scheduler.stats import prefill_backlog

TOKEN = 7


class NullDecoder:
    """Token ids to text without a tokenizer: one character a token."""

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


class SimWorker:
    """The worker link the batcher plans for; its answers are computed, not run: every sequence
    that reaches the end of its known tokens gets token 7, and one that reaches its max_tokens is
    finished (LENGTH). Also bench/scheduler_overhead.py's instant worker."""

    def __init__(self, num_blocks: int, device_type: str = "", address: str = "simulated",
                 make_pool=KVBlockPool):
        self.index, self.address = 0, address
        self.info = worker_pb2.WorkerInfo(num_blocks=num_blocks, block_size=BLOCK_TOKENS,
                                          max_context=1 << 20, device_type=device_type)
        self.pool = make_pool(num_blocks, BLOCK_TOKENS)
        self.adapters: frozenset[str] = frozenset()
        self.max_loras = 0
        self.is_connected = True
        self.known: dict[int, list[int]] = {}    # seq id -> [tokens known, computed, to sample]

    def answer(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        for seq_id in plan.released_seq_ids:
            self.known.pop(seq_id, None)
        for new in plan.new_sequences:
            self.known[new.seq_id] = [len(new.prompt_token_ids), new.cached_tokens,
                                      new.sampling.max_tokens - new.num_generated]
        tokens = []
        for seq_id, num_tokens in zip(plan.scheduled_seq_ids, plan.scheduled_num_tokens):
            state = self.known[seq_id]
            state[1] += num_tokens
            if state[1] == state[0]:
                state[0] += 1
                state[2] -= 1
                tokens.append(SampledToken(seq_id, TOKEN, FinishReason.LENGTH if state[2] == 0 else None))
        return answer_tokens(worker_pb2.StepResult(step_id=plan.step_id), tokens, plan.packed_results)

    async def execute(self, plan: worker_pb2.StepPlan, sent=None) -> worker_pb2.StepResult:
        """The batcher's own execute() path (WorkerLink's interface): answered at once."""
        if sent is not None:
            sent.set_result(None)
        return self.answer(plan)

    async def close(self) -> None:
        self.is_connected = False


class StepPool(PoolBase):
    """prefix_caching: the scheduler's prefix cache (its default settings), for requests that
    carry their prompt_ids (a replayed run): shared blocks are held once and count in the KV the
    step time reads, as in the real pool."""

    def __init__(self, name: str, accelerator: Accelerator, settings: QoSSettings | None = None,
                 policy: str = "qos", prefix_caching: bool = False):
        super().__init__(name, accelerator)
        defaults = SchedulerConfig()
        cache = PrefixCache(dict(zip(ORDER, map(float, defaults.cache_idle_shares))),
                            defaults.cache_affinity_margin) if prefix_caching else None
        self.worker = SimWorker(accelerator.kv_blocks, accelerator.device,
                                make_pool=cache.make_pool if cache else KVBlockPool)
        self.now = 0.0                           # simulated seconds: the batcher's clock
        self.batcher = ContinuousBatcher(name, [self.worker], create_policy(policy, settings or QoSSettings()),
                                         max_running=accelerator.max_running,
                                         max_step_tokens=accelerator.max_step_tokens, clock=lambda: self.now,
                                         prefix_cache=cache)
        self.requests: dict[int, SimRequest] = {}
        self.admitted: dict[int, Request] = {}   # seq id -> the scheduler's request (its cached tokens)
        self.plans = {}
        self.cut_in_steps = 0
        self._cut_ins: list[tuple[float, int, object]] = []   # (done at, order, builder)
        self._cut_ins_free_at = 0.0

    def submit(self, request: SimRequest, now: float) -> float | None:
        seq_id = request.request_id + 1
        if request.prompt_ids is not None:
            prompt = list(request.prompt_ids)
        else:   # tokens a replayed run's prefix cache served, when only their count is known: not computed
            prompt = [3] * max(1, request.prompt_tokens - request.cached_tokens)
        self.requests[seq_id] = request
        admitted = self.admitted[seq_id] = Request(
            request_id=str(seq_id), seq_id=seq_id, priority=request.priority, tenant=request.tenant, prompt_ids=prompt,
            sampling=SamplingParams(temperature=0.0, max_tokens=request.output_tokens),
            detokenizer=IncrementalDetokenizer(NullDecoder(), prompt))
        self.batcher.submit(admitted)
        if self.busy_until is None:
            return self._plan(now)
        if request.priority == HIGH and self.batcher.policy.cut_in and self._cut_in(now):
            return self.next_event()
        return None

    def next_event(self) -> float | None:
        """When the step in flight or the next cut-in inside it ends."""
        return min(self._cut_ins[0][0], self.busy_until) if self._cut_ins else self.busy_until

    def step_end(self, now: float) -> float | None:
        """The pool's event at `now`: a cut-in's end, or the step's. Returns the next one."""
        if self._cut_ins and self._cut_ins[0][0] <= now:
            _, _, builder = heapq.heappop(self._cut_ins)
            self._answer(builder, now, at_once=True)
            return self.next_event()
        for builder in self.plans.values():
            self._answer(builder, now)
        self.plans = {}
        self.busy_until = None
        return self._plan(now)

    def _answer(self, builder, now: float, at_once: bool = False) -> None:
        result = self.worker.answer(builder.plan)
        self.batcher.postprocess(self.worker, builder, result, at_once=at_once)
        for token in sampled_tokens(result):
            request = self.requests.get(token.seq_id)
            if request is None:
                continue
            if request.first_token_at is None:
                if request.prompt_ids is not None:      # what this pool's cache served
                    request.cached_tokens = self.admitted[token.seq_id].cached_tokens
                self.first_token(request, now)
            if token.finish_reason:
                self.admitted.pop(token.seq_id, None)
                self.finish(self.requests.pop(token.seq_id), now)

    def _cut_in(self, now: float) -> bool:
        """As CutInDispatch.dispatch: only into a step with work and no first tokens of its own."""
        if not self.plans or any(b.first_tokens or not b.has_work for b in self.plans.values()):
            return False
        batcher = self.batcher
        builder = batcher.planner.plan_cut_in(self.worker, batcher._next_step_id())
        if builder is None:
            return False
        # Only new sequences: the KV it reads is its own prompt, not what the pool holds.
        step_s = self.step_s(builder.num_tokens, builder.num_tokens, now)
        start = max(now, self._cut_ins_free_at)
        self._cut_ins_free_at = start + step_s
        heapq.heappush(self._cut_ins, (start + step_s, self.cut_in_steps, builder))
        self.cut_in_steps += 1
        self._scheduled([builder], start)
        self.busy_until += step_s               # the step in flight waits while the cut-in runs
        self.busy_s += step_s
        self.step_seconds += step_s
        self.step_tokens += builder.num_tokens
        self.cut_in_started(builder, now)
        return True

    def cut_in_started(self, builder, now: float) -> None:
        """A cut-in was planned (for subclasses that measure)."""

    def _plan(self, now: float) -> float | None:
        self.now = now
        plans = self.batcher.plan_step()
        tokens = sum(b.num_tokens for b in plans.values())
        if not tokens:
            for builder in plans.values():           # heartbeats only: answered at once
                self.batcher.postprocess(self.worker, builder, self.worker.answer(builder.plan))
            return None
        step_s = self.step_s(tokens, self.kv_used(), now)
        self._scheduled(plans.values(), now)
        self.plans = plans
        self.steps += 1
        self.step_tokens += tokens
        self.step_kv_tokens += self.kv_used()
        self.step_seconds += step_s
        self.busy_s += step_s
        self.busy_until = now + step_s
        return self.busy_until

    def _scheduled(self, builders, start: float) -> None:
        """Requests computed for the first time in a step starting at `start`."""
        for builder in builders:
            for new in builder.plan.new_sequences:
                request = self.requests.get(new.seq_id)
                if request is not None and request.scheduled_at is None:
                    request.scheduled_at = start

    # --- state for reports --------------------------------------------------------------------

    def prefill_left(self, p: int) -> int:
        return self.backlog[p]

    def waiting(self, p: int) -> int:
        return self.batcher.policy.waiting(p)

    def running(self, p: int) -> int:
        return sum(1 for r in self.batcher.running[0] if r.priority == p)

    def kv_used(self) -> int:
        return self.worker.pool.num_used * BLOCK_TOKENS

    def weights(self) -> tuple:
        w = self.batcher.policy.weights()
        return tuple(w[p] for p in ORDER)

    def kv_by_class(self) -> tuple:
        held = self.worker.pool.holdings()
        return tuple(held.get(p, 0) * BLOCK_TOKENS for p in ORDER)

    def kv_caps(self) -> tuple:
        return tuple(self.batcher.policy.kv_cap(p) for p in ORDER)

    def report(self, now: float, with_ttft: bool = True):
        self.backlog = prefill_backlog(self.batcher)
        self.preemptions = self.batcher.preemptions
        self.recomputed = self.batcher.planner.recomputed_tokens
        self.served = self.batcher.served_tokens
        return super().report(now, with_ttft)
