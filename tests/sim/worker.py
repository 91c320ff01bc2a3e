"""A simulated worker process and its Execute stream, as services/worker/server.py behaves: one
stream at a time; plans applied to the real worker-side SequenceTable (a plan that does not fit
it is refused, as the real worker refuses it); cut-ins that arrive while a step computes run
inside it and are answered first; a stream that ends drops every sequence; a draining worker
ends its stream once it holds nothing.

Its KV cache is modelled: each block holds the token ids written into it. A sequence that reads a
block another sequence overwrote, or a cached prefix block that does not hold its tokens,
samples a wrong token (and the run records a corruption): two owners of one block show up as
a text that is not the fault-free one, as they would on a real device.
"""
from __future__ import annotations

import asyncio
from collections import deque

import grpc

from services.common.errors import ErrorKind, ServiceError
from services.common.proto.qos.v1 import worker_pb2
from services.common.step import FinishReason, SampledToken
from services.common.wire import answer_tokens
from services.worker.sequences import PlanError, SequenceTable
from tests.sim.model import EOS, next_token

END = object()      # the stream ended cleanly (the server's handler returned)


def rpc_error(code: grpc.StatusCode, details: str, error: ServiceError | None = None) -> grpc.aio.AioRpcError:
    trailers = grpc.aio.Metadata(*error.trailers()) if error is not None else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details)


class SimWorker:
    """One worker process at one address; restart() is a new process under the same address."""

    def __init__(self, sim, address: str, num_blocks: int, block_size: int, adapters: dict[str, str]):
        self.sim = sim
        self.address = address
        self.num_blocks, self.block_size = num_blocks, block_size
        self.base_adapters = dict(adapters)
        self.tier_blocks = 0                     # its second KV tier's slots (0: none)
        self.generation = 0
        self.alive = False
        self.start()

    def start(self) -> None:
        self.generation += 1
        self.alive = True
        self.table = SequenceTable(self.block_size)
        self.kv: dict[int, list] = {}            # block -> token id at each of its slots
        self.writer: dict[int, int] = {}         # block -> seq id that last wrote it
        self.corrupted: set[int] = set()         # seq ids that read K/V not theirs
        self.tier: dict[int, list] = {}          # tier slot -> the block contents saved there
        self.adapters = dict(self.base_adapters)
        self.draining = False
        self.session: Session | None = None
        self.stalled_until = 0.0

    # --- the process ------------------------------------------------------------------------------

    def crash(self, why: str) -> None:
        if self.session is not None:
            self.session.end(rpc_error(grpc.StatusCode.UNAVAILABLE, f"Socket closed ({why})"))
        self.alive = False

    def stall(self, seconds: float) -> None:
        """SIGSTOP for `seconds`, then SIGCONT: nothing this process does moves meanwhile."""
        self.stalled_until = max(self.stalled_until, self.sim.loop.now + seconds)

    async def awake(self) -> None:
        while self.sim.loop.now < self.stalled_until:
            await asyncio.sleep(self.stalled_until - self.sim.loop.now)

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            model="sim", device="sim", num_blocks=self.num_blocks, block_size=self.block_size,
            max_context=4096, vocab_size=200, eos_token_ids=[EOS], draining=self.draining,
            kv_tier_blocks=self.tier_blocks, kv_tier_load_us_per_block=1.0,
            adapters=[worker_pb2.AdapterInfo(name=n, path=p) for n, p in sorted(self.adapters.items())])

    # --- adapters (services/worker/adapters.py: never under a sequence) -------------------------------

    def _refuse_in_use(self, name: str) -> None:
        if any(s.lora == name for s in self.table.sequences.values()):
            raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, f"LoRA adapter {name!r} is in use",
                            ServiceError(ErrorKind.CONFLICT, "in use", retry_after_ms=1000, reason="adapter_in_use"))

    def load_adapter(self, request: worker_pb2.LoadAdapterRequest) -> worker_pb2.LoadAdapterReply:
        if request.name in self.adapters:
            self._refuse_in_use(request.name)
        self.adapters[request.name] = request.path
        return worker_pb2.LoadAdapterReply()

    def unload_adapter(self, request: worker_pb2.UnloadAdapterRequest) -> worker_pb2.UnloadAdapterReply:
        self._refuse_in_use(request.name)
        self.adapters.pop(request.name, None)
        return worker_pb2.UnloadAdapterReply()

    # --- the model over the KV cache -------------------------------------------------------------------

    def block_at(self, seq, index: int) -> int | None:
        """The block holding the sequence's `index`-th block of positions (None: dropped)."""
        if seq.window is not None and index:
            if index <= seq.dropped_blocks:
                return None
            index -= seq.dropped_blocks
        return seq.block_table[index]

    def still_read(self, seq, block: int) -> bool:
        """Will the sequence read this block of its table again? (A streaming sequence's blocks
        before its window are passed: the scheduler may give them away before the worker hears
        that they were dropped, with its next plan.)"""
        if block not in seq.block_table:
            return False
        index = seq.block_table.index(block)
        if seq.window is None or index == 0:
            return True
        return index + seq.dropped_blocks >= seq.window.first_kept_block(seq.computed, self.block_size)

    def copy_tier(self, plan: worker_pb2.StepPlan) -> None:
        """The plan's copies between the pool and the tier, in order (services/engine/kv_tier.py):
        a load must fill a block no sequence still reads (but those the plan releases, dropped
        before it computes) from a slot that was saved."""
        for block, slot, load in zip(plan.tier_block_ids, plan.tier_slots, plan.tier_loads):
            if slot >= self.tier_blocks or block >= self.num_blocks:
                self.sim.invariants.fail(f"{self.address}: tier copy of block {block} / slot {slot} out of range")
            if not load:
                self.tier[slot] = list(self.kv.get(block, [None] * self.block_size))
                continue
            if slot not in self.tier:
                self.sim.invariants.fail(f"{self.address}: step {plan.step_id} loads tier slot {slot}, never saved")
            previous = self.writer.pop(block, None)
            sequences = self.table.sequences
            if previous is not None and previous in sequences and previous not in plan.released_seq_ids \
                    and self.still_read(sequences[previous], block):
                self.corrupt(previous, f"block {block} overwritten by a tier load")
            self.kv[block] = list(self.tier[slot])

    def admitted(self, new: worker_pb2.NewSequence) -> None:
        """A new sequence's cached prefix blocks must hold its tokens already."""
        seq, bs = self.table.sequences[new.seq_id], self.block_size
        for index in range(new.cached_tokens // bs):
            block = seq.block_table[index]
            if self.kv.get(block, [])[:bs] != seq.tokens[index * bs:(index + 1) * bs]:
                self.corrupt(new.seq_id, f"cached block {block} does not hold its prefix")

    def corrupt(self, seq_id: int, why: str) -> None:
        self.corrupted.add(seq_id)
        self.sim.note_corruption(self.address, seq_id, why)

    def compute(self, batch) -> list[SampledToken]:
        bs, kv, writer, sequences = self.block_size, self.kv, self.writer, self.table.sequences
        tokens = []
        for work in batch.sequences:
            seq = sequences[work.seq_id]
            position = work.position
            while position < work.end:
                index, offset = divmod(position, bs)
                block = self.block_at(seq, index)
                stop = min(work.end, (index + 1) * bs)
                previous = writer.get(block)
                if previous is not None and previous != work.seq_id and previous in sequences \
                        and self.still_read(sequences[previous], block):
                    self.corrupt(previous, f"block {block} overwritten by sequence {work.seq_id}")
                writer[block] = work.seq_id
                cells = kv.setdefault(block, [None] * bs)
                cells[offset:offset + stop - position] = seq.tokens[position:stop]
                position = stop
            if not work.sample:
                continue
            token = next_token(seq.tokens[:work.end], work.sampling.seed)
            if work.seq_id in self.corrupted:
                token = 3 + (token + 1) % 190
            params = work.sampling
            if token in params.stop_token_ids or (token == EOS and not params.ignore_eos):
                reason = FinishReason.STOP
            elif work.num_generated + 1 >= params.max_tokens:
                reason = FinishReason.LENGTH
            else:
                reason = None
            tokens.append(SampledToken(work.seq_id, token, reason))
        return tokens


class Session:
    """One Execute stream on a worker: plans read as they come, steps run in order."""

    def __init__(self, worker: SimWorker, call, plans):
        self.worker, self.call = worker, call
        self.sim = worker.sim
        self.queue: deque = deque()
        self.wake = asyncio.Event()
        self.closed = False
        self.hosting = False          # a step computes that cut-ins may run inside
        self.held: list = []          # cut-in answers held back (out of order)
        self.answered: list[int] = []
        self.tasks = [asyncio.ensure_future(self._read(plans)), asyncio.ensure_future(self._run())]

    def end(self, item) -> None:
        """The stream ends (`item`: END or an AioRpcError); the worker drops every sequence."""
        if self.closed:
            return
        self.closed = True
        self.call.deliver(item)
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        worker = self.worker
        if worker.session is self:
            worker.session = None
            worker.table.clear()
            worker.corrupted.clear()

    def send(self, answer: worker_pb2.StepResult) -> None:
        if not self.closed:
            self.call.deliver(answer)

    async def _read(self, plans) -> None:
        async for plan in plans:
            await self.worker.awake()
            if self.closed:
                return
            faults, now, where = self.sim.faults, self.sim.loop.now, f"{self.worker.address} step {plan.step_id}"
            if plan.step_id and faults.now("break_before_step", now, where):
                self._break(where)
                return
            if plan.cut_in and self.hosting:
                self.tasks.append(asyncio.ensure_future(self._cut_in(plan)))
                continue
            self.queue.append(plan)
            self.wake.set()
        self.queue.append(None)         # the scheduler closed its side
        self.wake.set()

    def _break(self, where: str) -> None:
        """The stream breaks (half the time the process dies with it, and restarts later)."""
        if self.sim.rng.random() < 0.5:
            self.sim.crash(self.worker, where)
        else:
            self.end(END if self.sim.rng.random() < 0.5 else
                     rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))

    async def _run(self) -> None:
        while True:
            while not self.queue:
                self.wake.clear()
                await self.wake.wait()
            plan = self.queue.popleft()
            if plan is None:
                self.end(END)
                return
            await self._step(plan)
            worker = self.worker
            if worker.draining and not worker.table.sequences and not self.queue:
                self.end(END)
                return

    def _apply(self, plan: worker_pb2.StepPlan):
        if self.closed:         # the stream is gone: its plans with it
            return None
        if sum(plan.scheduled_num_tokens) > self.sim.max_step_tokens:
            self.sim.invariants.fail(f"step {plan.step_id} schedules {sum(plan.scheduled_num_tokens)} tokens, "
                                     f"the step budget is {self.sim.max_step_tokens}")
        self.worker.copy_tier(plan)
        try:
            batch = self.worker.table.apply(plan)
        except PlanError as exc:
            self.sim.note_plan_error(self.worker.address, plan.step_id, str(exc))
            self.send(worker_pb2.StepResult(step_id=plan.step_id, error=str(exc)))
            return None
        for new in plan.new_sequences:
            self.worker.admitted(new)
        return batch

    async def _step(self, plan: worker_pb2.StepPlan) -> None:
        batch = self._apply(plan)
        if batch is None:
            return
        sim, faults, now = self.sim, self.sim.faults, self.sim.loop.now
        where = f"{self.worker.address} step {plan.step_id}"
        work = sum(len(w.token_ids) for w in batch.sequences)
        seconds = 0.002 + 0.00005 * work if batch.sequences else 0.0002
        if faults.now("late", now, where):
            seconds += sim.rng.uniform(0, 0.6 * sim.step_timeout_s)
        if faults.now("hang", now, where):
            hang = sim.step_timeout_s + sim.rng.uniform(0.05, 2.0)
            self.worker.stall(hang)
        if faults.now("break_mid_step", now, where):
            sim.loop.call_later(sim.rng.uniform(0, seconds), self._break, where)
        self.hosting = bool(batch.sequences) and not any(w.lora for w in batch.sequences)
        await asyncio.sleep(seconds)
        await self.worker.awake()
        self.hosting = False
        if self.closed:
            return
        tokens = self.worker.compute(batch)
        self.worker.table.commit(batch, tokens)
        answer = answer_tokens(worker_pb2.StepResult(step_id=plan.step_id, draining=self.worker.draining),
                               tokens, plan.packed_results)
        self._answer(answer, where)
        for held in self.held:
            self.send(held)
        self.held.clear()

    async def _cut_in(self, plan: worker_pb2.StepPlan) -> None:
        """Inside the step in flight: answered before it (or after it, held: out of order)."""
        batch = self._apply(plan)
        if batch is None:
            return
        await asyncio.sleep(0.0005)
        if self.closed:
            return
        tokens = self.worker.compute(batch)
        self.worker.table.commit(batch, tokens)
        answer = answer_tokens(worker_pb2.StepResult(step_id=plan.step_id), tokens, plan.packed_results)
        where = f"{self.worker.address} cut-in {plan.step_id}"
        if self.hosting and self.sim.faults.now("reorder", self.sim.loop.now, where):
            self.held.append(answer)
        else:
            self._answer(answer, where)

    def _answer(self, answer: worker_pb2.StepResult, where: str) -> None:
        sim, faults, now = self.sim, self.sim.faults, self.sim.loop.now
        if answer.step_id and faults.now("broken_answer", now, where):
            answer.sampled_seq_ids.append(10 ** 9)
            answer.sampled_token_ids.append(5)
        if self.answered and faults.now("stale_step", now, where):
            self.send(worker_pb2.StepResult(step_id=sim.rng.choice(self.answered)))
        if answer.step_id and faults.now("wrong_step", now, where):
            answer.step_id += 10 ** 6
        self.send(answer)
        self.answered = (self.answered + [answer.step_id])[-4:]
        if faults.now("duplicate", now, where):
            self.send(answer)
        if answer.step_id and faults.now("break_between_steps", now, where):
            if sim.rng.random() < 0.5:
                sim.loop.call_soon(self._break, where)
            else:
                sim.loop.call_later(sim.rng.uniform(0, 0.002), self._break, where)
