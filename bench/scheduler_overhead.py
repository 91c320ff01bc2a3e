#!/usr/bin/env python
"""How long the scheduler takes to build one step plan, with 256 running and 1,000 queued sequences.

The real batcher and QoS policy plan steps for one worker whose execution is simulated (each
scheduled sequence advances, sampling a fixed token), so only planning is timed: per step,
plan_step() (reaping, lane choice, block allocation, the StepPlan protobuf). Steady state: 256
sequences decode (mixed priorities), 1,000 wait behind the max_running limit.

    python bench/scheduler_overhead.py [--json PATH] [--steps N] [--running N] [--queued N]

Beside the result: python_loop_ns, the calibration figure of bench/harness.py, from this run.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm  # noqa: E402

from bench.harness import calibration_line, machine, make_parser, python_loop_ns, quantile, write_json  # noqa: E402
from services.common.priority import ORDER  # noqa: E402
from services.common.proto.qos.v1 import worker_pb2  # noqa: E402
from services.common.step import SamplingParams  # noqa: E402
from services.scheduler.batcher import ContinuousBatcher  # noqa: E402
from services.scheduler.detokenizer import IncrementalDetokenizer  # noqa: E402
from services.common.kv_blocks import KVBlockPool  # noqa: E402
from services.scheduler.policy import create_policy  # noqa: E402
from services.scheduler.request import Request  # noqa: E402

PROMPT_TOKENS = 128


class NullDecoder:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


class InstantWorker:
    """A worker link whose steps complete at once: every sequence that reaches the end of its
    known tokens gets token 7."""

    def __init__(self, num_blocks: int):
        self.index, self.address = 0, "instant"
        self.info = worker_pb2.WorkerInfo(num_blocks=num_blocks, block_size=16, max_context=1 << 20)
        self.pool = KVBlockPool(num_blocks, 16)
        self.adapters: frozenset[str] = frozenset()
        self.known: dict[int, int] = {}
        self.is_connected = True

    async def close(self) -> None:
        self.is_connected = False

    async def execute(self, plan):
        for seq_id in plan.released_seq_ids:
            self.known.pop(seq_id, None)
        for new in plan.new_sequences:
            self.known[new.seq_id] = [len(new.prompt_token_ids), 0]
        tokens = []
        for seq_id, num_tokens in zip(plan.scheduled_seq_ids, plan.scheduled_num_tokens):
            state = self.known[seq_id]
            state[1] += num_tokens
            if state[1] == state[0]:
                state[0] += 1
                tokens.append(worker_pb2.SampledToken(seq_id=seq_id, token_id=7))
        return worker_pb2.StepResult(step_id=plan.step_id, tokens=tokens)


def request(seq_id: int) -> Request:
    prompt = [3] * PROMPT_TOKENS
    return Request(request_id=f"r{seq_id}", seq_id=seq_id, priority=ORDER[seq_id % 3], tenant="",
                   prompt_ids=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=1_000_000),
                   detokenizer=IncrementalDetokenizer(NullDecoder(), prompt))


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--queued", type=int, default=1000)
    parser.add_argument("--policy", default="qos", choices=["qos", "fcfs"])
    args = parser.parse_args()

    worker = InstantWorker(num_blocks=200_000)
    batcher = ContinuousBatcher("bench", [worker], create_policy(args.policy),
                                max_running=args.running, max_step_tokens=2 * args.running)
    for seq_id in range(1, args.running + args.queued + 1):
        batcher.submit(request(seq_id))

    async def step() -> float:
        started = time.perf_counter()
        builders = batcher.plan_step()
        elapsed = time.perf_counter() - started
        await batcher.execute(builders)
        return elapsed

    async def run() -> list[float]:
        # Warm up until every running slot is decoding (prompts prefilled).
        while len(batcher.running[0]) < args.running or any(r.pending > 1 for r in batcher.running[0]):
            await step()
        return [await step() for _ in tqdm(range(args.steps), desc="planning", file=sys.stderr)]

    times_us = [t * 1e6 for t in asyncio.run(run())]
    p50, p99 = quantile(times_us, 0.5), quantile(times_us, 0.99)
    loop_ns = python_loop_ns()
    print(f"policy {args.policy}: {args.running} running, {len(batcher.policy)} queued, {args.steps} steps "
          f"on {machine(cpu=False)}")
    print(f"plan_step: p50 {p50:.0f} us, p99 {p99:.0f} us (target p99 < 1000 us)")
    print(calibration_line(loop_ns))
    write_json(args.json, {"plan_p50_us": p50, "plan_p99_us": p99, "policy": args.policy,
                           "running": args.running, "queued": len(batcher.policy),
                           "steps": args.steps, "python_loop_ns": loop_ns})


if __name__ == "__main__":
    main()
