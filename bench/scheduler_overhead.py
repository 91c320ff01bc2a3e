#!/usr/bin/env python
"""How long the scheduler takes to build one step plan, and how that grows with running and
queued sequences.

The real batcher and QoS policy plan steps for one worker whose execution is simulated (each
scheduled sequence advances, sampling a fixed token), so only the scheduler's work is timed:
per step, plan_step() (reaping, lane choice, block allocation, preemption, the StepPlan
protobuf), and postprocessing (below). After each step every stream's chunks are taken off its
queue, untimed, as the Submit handlers that read them do in a server (until 2026-12-01 they were
left there: ~70,000 chunks alive that no server holds, which slowed planning by ~10% at p50 and
~25% at p99).

Headline: 256 sequences running (mixed priorities, 50 tenants of weights 1-3), 1,000 queued
behind the max_running limit. Requests finish (outputs of 32-512 tokens) and the queue is topped
up after every step, so each step also admits, prefills and preempts as a live pool does.
Curves: the same at 64 / 256 / 1,024 running (1,000 queued) and 1,000 / 10,000 queued (256
running), fewer steps each; the cost per step should grow with running sequences only.

    python bench/scheduler_overhead.py [--json PATH] [--steps N] [--running N] [--queued N]
                                       [--tenants N] [--no-curves]

Also timed, beside the plan, the rest of a step's scheduling, in two parts as the server's loop
runs them: postprocessing, what the scheduler does with the step's answer before it can plan the
next one (each sampled token recorded on its request; requests the engine ended, out; the
simulated worker's own time left out), and streaming, what it does after sending that plan, while
the worker computes (the plan's own bookkeeping: its decodes charged to their tenants' shares,
the KV peaks; then each token's text with a stand-in decoder, stop strings, its chunk onto the
request's queue). Until 2026-12-01 streaming happened before the next plan, and until
2026-12-02 the tenants' shares were charged inside the plan.

Beside the result: python_loop_ns, the calibration figure of bench/harness.py, from this run,
and the tail of a fixed pure-Python task timed between the steps (harness.FixedTask): its
p99/p50 is what the machine adds to the plan's p99 by itself (~1.5 on this project's 2-core
machine, 2026-12-01, against the plan's ~1.7-1.9).
Target: plan p99 <= 1,000 us, <= 600 us where python_loop_ns <= 80.
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm  # noqa: E402

from bench.harness import (FixedTask, calibration_line, machine, make_parser, python_loop_ns, quantile,  # noqa: E402
                           write_json)
from bench.sim.step_pool import NullDecoder, SimWorker  # noqa: E402
from services.common.priority import ORDER  # noqa: E402
from services.common.step import SamplingParams  # noqa: E402
from services.scheduler.batcher import ContinuousBatcher  # noqa: E402
from services.scheduler.detokenizer import IncrementalDetokenizer  # noqa: E402
from services.scheduler.policy import create_policy  # noqa: E402
from services.scheduler.request import Request  # noqa: E402

PROMPT_TOKENS = 128
OUTPUT_RANGE = (32, 512)
CURVE_STEPS = 400
RUNNING_CURVE = (64, 256, 1024)      # at 1,000 queued
QUEUED_CURVE = (1_000, 10_000)       # at 256 running


class Workload:
    """Requests of 3 classes in turn, spread over `tenants` tenants of weight 1-3."""

    def __init__(self, tenants: int, seed: int = 0):
        self.rng = random.Random(seed)
        self.tenants = tenants
        self.next_id = 1

    def request(self) -> Request:
        seq_id, self.next_id = self.next_id, self.next_id + 1
        prompt = [3] * PROMPT_TOKENS
        tenant = seq_id % self.tenants
        return Request(request_id=f"r{seq_id}", seq_id=seq_id, priority=ORDER[seq_id % 3],
                       tenant=f"tenant{tenant}", tenant_weight=1.0 + tenant % 3, prompt_ids=prompt,
                       sampling=SamplingParams(temperature=0.0, max_tokens=self.rng.randint(*OUTPUT_RANGE)),
                       detokenizer=IncrementalDetokenizer(NullDecoder(), prompt))


class TimedSimWorker(SimWorker):
    """The instant worker, adding up how long building its answers took: simulation, not
    scheduling, so left out of the postprocessing time."""
    answer_seconds = 0.0

    def answer(self, plan):
        started = time.perf_counter()
        try:
            return super().answer(plan)
        finally:
            self.answer_seconds += time.perf_counter() - started


class OverheadRun:
    """One pool of `running` sequences and `queued` waiting requests, stepped as the server's loop
    steps it (ContinuousBatcher.run) with its worker's execution simulated: each step() returns
    the seconds spent planning, postprocessing (the simulated worker's own time left out) and
    streaming. Also used by bench/scheduler_ab.py, which steps two source trees' runs in turn."""

    def __init__(self, policy: str, running: int, queued: int, tenants: int):
        self.running, self.queued = running, queued
        self.worker = TimedSimWorker(num_blocks=running * 64, address="instant")
        self.batcher = ContinuousBatcher("bench", [self.worker], create_policy(policy),
                                         max_running=running, max_step_tokens=2 * running)
        self.workload = Workload(tenants)
        for _ in range(running + queued):
            self.batcher.submit(self.workload.request())
        self.batcher.hold_streams = True        # as run() does: text and chunks after the next plan
        self.streamed: list[Request] = []       # the last step's scheduled requests: chunks to read
        self.fixed_task = FixedTask()           # the machine's own tail, sampled between the steps

    def _read_and_top_up(self) -> None:
        """What happens in a server while the worker computes (untimed): the Submit handlers read
        the last step's chunks off their queues, and new requests arrive (the pool is kept as
        full as it started)."""
        for request in self.streamed:
            events = request.events
            while not events.empty():
                events.get_nowait()
        batcher = self.batcher
        for _ in range(self.running + self.queued - len(batcher.policy) - len(batcher.running[0])):
            batcher.submit(self.workload.request())

    async def step(self) -> tuple[float, float, float]:
        """In the order of the server's loop: the next plan right after the last step's
        postprocessing; then, while the worker computes, the plan's tenant shares (settle_plans),
        the last step's tokens made into text and chunks (release_streams), and the handlers."""
        batcher, worker = self.batcher, self.worker
        started = time.perf_counter()
        builders = batcher.plan_step()
        planned = time.perf_counter()
        batcher.settle_plans()
        batcher.release_streams()
        streamed_s = time.perf_counter() - planned
        self._read_and_top_up()
        self.streamed = [r for builder in builders.values() for r in builder.scheduled_requests]
        answering = worker.answer_seconds
        executing = time.perf_counter()
        await batcher.execute(builders)
        postprocessed = time.perf_counter() - executing - (worker.answer_seconds - answering)
        return planned - started, postprocessed, streamed_s

    async def warm_up(self) -> None:
        """Every slot taken and the first wave of prompts prefilled."""
        running = self.batcher.running[0]
        while len(running) < self.running or any(r.pending > 1 for r in running):
            await self.step()

    def admitted_and_preempted(self) -> tuple[int, int]:
        return sum(self.batcher.planner.admitted.values()), self.batcher.preemptions


def measure(policy: str, running: int, queued: int, tenants: int, steps: int,
            label: str) -> dict:
    """Plan `steps` steps at steady state; returns p50/p99 in us of planning and of
    postprocessing, and what the steps did."""
    pool = OverheadRun(policy, running, queued, tenants)

    async def step() -> tuple[float, float, float]:
        times = await pool.step()
        pool.fixed_task.run()
        return times

    async def run() -> tuple[list[tuple[float, float, float]], int, int]:
        await pool.warm_up()
        admitted, preempted = pool.admitted_and_preempted()
        times = [await step() for _ in tqdm(range(steps), desc=label, file=sys.stderr, leave=False)]
        admitted_after, preempted_after = pool.admitted_and_preempted()
        return times, admitted_after - admitted, preempted_after - preempted

    times, admitted, preempted = asyncio.run(run())
    fixed_task = pool.fixed_task
    plan_us = [plan * 1e6 for plan, _, _ in times]
    post_us = [post * 1e6 for _, post, _ in times]
    stream_us = [stream * 1e6 for _, _, stream in times]
    return {"running": running, "queued": queued, "steps": steps,
            "p50_us": quantile(plan_us, 0.5), "p99_us": quantile(plan_us, 0.99),
            "postprocess_p50_us": quantile(post_us, 0.5), "postprocess_p99_us": quantile(post_us, 0.99),
            "streaming_p50_us": quantile(stream_us, 0.5), "streaming_p99_us": quantile(stream_us, 0.99),
            "admitted_per_step": admitted / steps, "preempted_per_step": preempted / steps,
            "fixed_task_p50_us": fixed_task.p50_us(), "fixed_task_p99_over_p50": fixed_task.tail_ratio()}


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--queued", type=int, default=1000)
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--policy", default="qos", choices=["qos", "fcfs"])
    parser.add_argument("--no-curves", action="store_true", help="only the headline figure")
    args = parser.parse_args()

    head = measure(args.policy, args.running, args.queued, args.tenants, args.steps, "headline")
    curves = []
    if not args.no_curves:
        shapes = [(r, QUEUED_CURVE[0]) for r in RUNNING_CURVE] + \
                 [(args.running, q) for q in QUEUED_CURVE[1:]]
        curves = [measure(args.policy, r, q, args.tenants, CURVE_STEPS, f"{r} running, {q} queued")
                  for r, q in shapes]
    loop_ns = python_loop_ns()
    target = 600 if loop_ns <= 80 else 1000
    print(f"policy {args.policy}: {head['running']} running, {head['queued']} queued, {args.tenants} "
          f"tenants, {args.steps} steps on {machine(cpu=False)}")
    print(f"plan_step: p50 {head['p50_us']:.0f} us, p99 {head['p99_us']:.0f} us (target p99 <= {target} us "
          f"at this python_loop_ns); per step {head['admitted_per_step']:.2f} admitted, "
          f"{head['preempted_per_step']:.2f} preempted")
    print(f"postprocess: p50 {head['postprocess_p50_us']:.0f} us, p99 {head['postprocess_p99_us']:.0f} us a step "
          f"(the step's sampled tokens recorded, before the next plan; no target)")
    print(f"streaming: p50 {head['streaming_p50_us']:.0f} us, p99 {head['streaming_p99_us']:.0f} us a step "
          f"(the plan's tenant shares, then the tokens' text and chunks: after the plan is sent, while "
          f"the worker computes)")
    print(f"jitter: plan p99/p50 {head['p99_us'] / head['p50_us']:.2f}; a fixed pure-Python task timed between the "
          f"steps (p50 {head['fixed_task_p50_us']:.0f} us), p99/p50 {head['fixed_task_p99_over_p50']:.2f}: what this "
          f"machine adds to a tail by itself now")
    print(calibration_line(loop_ns))
    if curves:
        print(f"\n{'running':>8} {'queued':>8} {'p50 us':>8} {'p99 us':>8} {'p50 us/running':>15} "
              f"{'postprocess p50 us':>19} {'streaming p50 us':>17}")
        for c in curves:
            print(f"{c['running']:>8} {c['queued']:>8} {c['p50_us']:>8.0f} {c['p99_us']:>8.0f} "
                  f"{c['p50_us'] / c['running']:>15.2f} {c['postprocess_p50_us']:>19.0f} "
                  f"{c['streaming_p50_us']:>17.0f}")
    write_json(args.json, {"plan_p50_us": head["p50_us"], "plan_p99_us": head["p99_us"],
                           "postprocess_p50_us": head["postprocess_p50_us"],
                           "postprocess_p99_us": head["postprocess_p99_us"],
                           "streaming_p50_us": head["streaming_p50_us"],
                           "streaming_p99_us": head["streaming_p99_us"],
                           "policy": args.policy, "running": head["running"], "queued": head["queued"],
                           "tenants": args.tenants, "steps": args.steps,
                           "admitted_per_step": head["admitted_per_step"],
                           "preempted_per_step": head["preempted_per_step"],
                           "target_p99_us": target, "curves": curves, "python_loop_ns": loop_ns,
                           "fixed_task_p50_us": head["fixed_task_p50_us"],
                           "fixed_task_p99_over_p50": head["fixed_task_p99_over_p50"]})


if __name__ == "__main__":
    main()
