"""The engine: one continuous-batching step at a time over a paged KV cache.

    engine = Engine(EngineConfig(model_dir=...))
    output = engine.step(StepBatch([...]))   # prefill chunks and decodes, mixed

The caller (the worker, on behalf of the scheduler) owns block allocation and sends block tables;
the engine checks every entry before touching a tensor, so a bad plan is an InvalidStepError
naming the sequence, never an index error from inside torch.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch

from services.common.config import DECODE_ATTENTION
from services.common.step import FinishReason, PromptLogprobs, SampledToken, StepBatch, StepOutput, SequenceWork
from services.engine.config import ModelConfig, load_model_config
from services.engine.device import DeviceBackend, dtype_reason, open_backend, resolve_dtype, set_cpu_threads
from services.engine.grammar import Grammars, overlap_masks
from services.engine.host_memory import keep_freed_memory
from services.engine.kv_cache import DEFAULT_BLOCK_SIZE, KVCacheSpec, PagedKVCache, size_kv_cache
from services.engine.linear import bound_onednn_caches
from services.engine.lora import AdapterSet, LoraAdapter, LoraBatch, load_peft_adapter
from services.engine.model import AttentionLayout, LlamaDecoder
from services.engine.paged_attention import PagedKernel, load_paged_kernel, paged_kernel_takes
from services.engine.sampler import sample_step, target_logprobs
from services.common.kv_blocks import blocks_for_tokens as blocks_for
from services.common.stream_window import kept_blocks, table_index
from services.engine.step_layout import StepLayouter
from services.engine.weights import load_safetensors

log = logging.getLogger(__name__)


class InvalidStepError(ValueError):
    """A step entry the engine refuses to compute (the message names the sequence)."""


@dataclass(slots=True)
class EngineConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str | None = None                # None: the device's choice (bf16 where it has native bf16, else fp32/fp16)
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_bytes: int | None = None       # explicit KV budget; overrides the fraction
    kv_cache_fraction: float = 0.1          # of free device memory, after the weights are loaded
    num_threads: int = 0                    # CPU intra-op threads; 0 = all cores of this process
    seed: int = 0                           # for requests that sample without a seed of their own
    prepack_linear: bool = True             # CPU: weights packed for the C kernel or oneDNN (services/engine/linear.py)
    max_loras: int = 4                      # LoRA adapters on the device at once (and in one step)
    max_cpu_loras: int = 16                 # adapters loaded (host copies); beyond, the least recently used idle one goes
    # Decode and prompt attention: "auto" = the paged C kernel on CPU in fp32 or bf16 where it builds
    # and takes the model's head size (else "torch"), "kernel" = that kernel or fail, "torch" = SDPA
    # over the gathered context (services/engine/paged_attention.py).
    decode_attention: str = "auto"
    prompt_attention: str = "auto"
    # Where the kernel attends decodes and prompts and every linear layer runs on the C kernel, a
    # token's logits are the same bits however it was batched, chunked or recomputed
    # (services/engine/step_layout.py); this setting asks for that, and warns at start where it
    # cannot hold (GPU, NPU, fp16, an attention setting "torch", bf16 without avx512_bf16).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        for name in ("decode_attention", "prompt_attention"):
            if getattr(self, name) not in DECODE_ATTENTION:
                raise ValueError(f"{name} must be one of {', '.join(DECODE_ATTENTION)}, got {getattr(self, name)!r}")
        if not 1 <= self.max_loras <= self.max_cpu_loras:
            raise ValueError(f"need 1 <= max_loras <= max_cpu_loras, got {self.max_loras} and {self.max_cpu_loras}")


class Engine:
    def __init__(self, config: EngineConfig, backend: DeviceBackend | None = None):
        """`backend`: the device already opened (the worker opens it first, to fail fast)."""
        self.config = config
        self.threads = set_cpu_threads(config.num_threads)
        self.backend = backend or open_backend(config.device)
        self.device = self.backend.device
        self.dtype = resolve_dtype(config.dtype, self.backend)
        if self.device.type == "cpu":
            keep_freed_memory()          # activations live in host memory (services/engine/host_memory.py)
            bound_onednn_caches()        # before the first primitive (services/engine/linear.py)
        self.model_config: ModelConfig = load_model_config(config.model_dir)
        c = self.model_config
        takes = paged_kernel_takes(c.head_dim, c.num_heads // c.num_kv_heads)
        # One kernel for both: a token is computed alike as a decode and inside a prompt.
        self.prompt_kernel = self._kernel("prompt_attention", takes)
        self.decode_kernel = self._kernel("decode_attention", takes)
        self.model = LlamaDecoder(self.model_config, load_safetensors(config.model_dir), self.device, self.dtype,
                                  config.prepack_linear, self.decode_kernel, self.prompt_kernel)
        budget = config.kv_cache_bytes or int(self.backend.memory().free_bytes * config.kv_cache_fraction)
        self.kv_spec: KVCacheSpec = size_kv_cache(self.model_config, self.dtype, budget,
                                                  config.block_size)
        # Keys transposed within their blocks where the kernel reads them (kv_cache.py).
        self.cache = PagedKVCache(self.model_config, self.kv_spec, self.device, self.dtype,
                                  keys_transposed=self.decode_kernel is not None or self.prompt_kernel is not None)
        kernel = self.decode_kernel is not None
        self.layouter = StepLayouter(self.kv_spec.block_size, self.device, kernel, self.prompt_kernel is not None)
        # Same bits for a token however it is batched, chunked or recomputed (step_layout.py).
        self.batch_invariant = (kernel and self.decode_kernel is self.prompt_kernel
                                and self.model.linears_on_kernel())
        if config.batch_invariant and not self.batch_invariant:
            log.warning("batch_invariant is set but cannot hold here: it needs the paged attention kernel for "
                        "decodes and prompts and every linear layer on the C kernel (CPU, fp32, or bf16 with "
                        "avx512_bf16, head size a multiple of 16); the engine-ready line names the paths this "
                        "engine has")
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)   # returns itself
        self.adapters = AdapterSet(self.device, config.max_loras, config.max_cpu_loras)
        self.grammars = Grammars(config.model_dir, self.model_config, overlap_masks(self.device, self.threads))
        log.info("engine ready: %s on %s, %s (%d threads); %s (%s); %s; decode attention: %s; prompt attention: %s; "
                 "linear: %s; batch-invariant: %s", self.model_config.architecture, self.device, self.backend.name,
                 self.threads, self.dtype, dtype_reason(config.dtype, self.backend), self.kv_spec.describe(),
                 "paged kernel" if kernel else "gather + SDPA", "paged kernel" if self.prompt_kernel else "SDPA",
                 self.model.layers[0].qkv.backend, "yes" if self.batch_invariant else "no")

    def _kernel(self, setting: str, takes_model: bool) -> PagedKernel | None:
        """The paged attention kernel that EngineConfig.<setting> asks for, or None (torch's path)."""
        choice = getattr(self.config, setting)
        if choice == "torch":
            return None
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16) or not takes_model:
            if choice == "kernel":
                raise ValueError(f"{setting}='kernel' needs fp32 or bf16 on CPU and a model its kernel takes, not "
                                 f"{self.dtype} on {self.device} with head_dim {self.model_config.head_dim}")
            return None
        kernel = load_paged_kernel()
        if kernel is None and choice == "kernel":
            raise RuntimeError(f"{setting}='kernel' but its kernel could not be built (the log says why)")
        return kernel

    @property
    def max_context(self) -> int:
        return self.model_config.max_context

    # --- LoRA adapters ------------------------------------------------------------------------

    def read_adapter(self, name: str, path) -> LoraAdapter:
        """Read and check an adapter on the host (any thread: no engine state is touched)."""
        return load_peft_adapter(name, path, self.model_config, self.dtype)

    def add_adapter(self, adapter: LoraAdapter, in_use: set[str] = frozenset()) -> list[str]:
        """A read adapter joins the loaded ones (engine thread, between steps); returns the names
        of idle adapters dropped past max_cpu_loras."""
        return self.adapters.add(adapter, in_use)

    def load_adapter(self, name: str, path) -> LoraAdapter:
        adapter = self.read_adapter(name, path)
        self.add_adapter(adapter)
        return adapter

    def remove_adapter(self, name: str) -> None:
        self.adapters.remove(name)

    def _lora_batch(self, ordered: list[SequenceWork]) -> LoraBatch | None:
        rows: dict[str, list[int]] = {}
        offset = 0
        for seq in ordered:
            if seq.lora:
                rows.setdefault(seq.lora, []).extend(range(offset, offset + len(seq.token_ids)))
            offset += len(seq.token_ids)
        return self.adapters.batch(rows) if rows else None

    def step(self, batch: StepBatch, pause: Callable[[], None] | None = None) -> StepOutput:
        """Compute every entry's tokens; sample one token for each entry with `sample` set.

        `pause`: called at points inside the forward pass (between layers, after each attention
        call or piece of one: LlamaDecoder.forward), after it and between the output head's
        pieces; it may run another step there (the worker's cut-ins), one that touches none of
        this step's sequences or cache blocks and, while this one uses a LoRA adapter, uses none."""
        started = time.perf_counter()
        ordered, token_ids, layout = self._prepare(batch)
        ends = list(accumulate(len(seq.token_ids) for seq in ordered))
        last_rows = [end - 1 for seq, end in zip(ordered, ends) if seq.sample]
        sampled = [seq for seq in ordered if seq.sample]
        masks = self.grammars.start_masks(sampled)     # during the forward where a core is free for it
        hidden = self.model.forward(token_ids, layout, self.cache, self._lora_batch(ordered), pause)
        if pause is not None:
            pause()
        tokens: list[SampledToken] = []
        if sampled:
            logits = self.model.logits(hidden[torch.tensor(last_rows, device=self.device)], pause)
            picks = sample_step(logits, sampled, self.generator, masks, self.model_config.eos_token_ids)
            failed = masks.failed if masks is not None else ()
            tokens = [SampledToken(s.seq_id, tid, FinishReason.ERROR if i in failed else self._finish_reason(s, tid), lp)
                      for i, (s, (tid, lp)) in enumerate(zip(sampled, picks))]
        prompt = [self._prompt_logprobs(seq, hidden, end) for seq, end in zip(ordered, ends) if seq.prompt_targets]
        return StepOutput(tokens=tokens, forward_seconds=time.perf_counter() - started, prompt_logprobs=prompt)

    def _prompt_logprobs(self, seq: SequenceWork, hidden: torch.Tensor, end: int) -> PromptLogprobs:
        """The logprobs of the prompt tokens after `seq`'s rows: its rows' own output head (a
        sequence that asks pays for its prompt's logits, nobody else)."""
        start = end - len(seq.token_ids)
        targets = list(seq.prompt_targets)
        logits = self.model.logits(hidden[start:start + len(targets)])
        entries = target_logprobs(logits, targets, seq.sampling.prompt_logprobs or 0)
        return PromptLogprobs(seq.seq_id, seq.position + 1, tuple(targets), entries)

    def compute_logits(self, batch: StepBatch) -> dict[int, torch.Tensor]:
        """Logits [len(token_ids), vocab] for every token of every entry (tests, debugging).

        Same path as step(), KV writes included, without sampling."""
        ordered, token_ids, layout = self._prepare(batch)
        logits = self.model.logits(self.model.forward(token_ids, layout, self.cache, self._lora_batch(ordered)))
        result, offset = {}, 0
        for seq in ordered:
            result[seq.seq_id] = logits[offset:offset + len(seq.token_ids)]
            offset += len(seq.token_ids)
        return result

    def _finish_reason(self, seq: SequenceWork, token_id: int) -> FinishReason | None:
        params = seq.sampling
        if token_id in params.stop_token_ids or (
                not params.ignore_eos and token_id in self.model_config.eos_token_ids):
            return FinishReason.STOP
        # The new token would sit at position seq.end: past the window it could never be fed back
        # (streaming mode has no such end).
        if seq.num_generated + 1 >= params.max_tokens or (seq.window is None and seq.end >= self.max_context):
            return FinishReason.LENGTH
        return None

    # --- checking and laying out a step -------------------------------------------------------

    def _prepare(self, batch: StepBatch) -> tuple[list[SequenceWork], torch.Tensor, AttentionLayout]:
        """Check the step's entries, then order them for the model and describe their attention."""
        self._validate(batch)
        return self.layouter(batch.sequences)

    def _validate(self, batch: StepBatch) -> None:
        if not batch.sequences:
            raise InvalidStepError("empty step: no sequences")
        loras = {s.lora for s in batch.sequences if s.lora}
        if len(loras) > self.adapters.max_loras:
            raise InvalidStepError(f"the step names {len(loras)} LoRA adapters; at most max_loras = "
                                   f"{self.adapters.max_loras} fit on the device at once")
        seen: set[int] = set()
        written: set[int] = set()
        block_size, num_blocks = self.kv_spec.block_size, self.kv_spec.num_blocks
        vocab = self.model_config.vocab_size
        for seq in batch.sequences:
            name = f"sequence {seq.seq_id}"
            if seq.seq_id in seen:
                raise InvalidStepError(f"{name} appears twice in one step")
            if seq.lora and seq.lora not in self.adapters:
                raise InvalidStepError(f"{name} names LoRA adapter {seq.lora!r}, but adapter {seq.lora!r} is "
                                       f"not loaded (loaded: {', '.join(sorted(self.adapters)) or 'none'})")
            seen.add(seq.seq_id)
            if not seq.token_ids:
                raise InvalidStepError(f"{name} has no tokens to compute")
            if seq.position < 0:
                raise InvalidStepError(f"{name} starts at negative position {seq.position}")
            bad = next((t for t in seq.token_ids if not 0 <= t < vocab), None)
            if bad is None and seq.prompt_targets:
                if len(seq.prompt_targets) > len(seq.token_ids):
                    raise InvalidStepError(f"{name} asks the logprobs of {len(seq.prompt_targets)} prompt tokens "
                                           f"after {len(seq.token_ids)} rows")
                bad = next((t for t in seq.prompt_targets if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidStepError(f"{name} has token id {bad} outside the vocabulary [0, {vocab})")
            if seq.window is None:
                if seq.end > self.max_context:
                    raise InvalidStepError(
                        f"{name} would reach position {seq.end - 1}, beyond the model's context window "
                        f"of {self.max_context} tokens")
                needed, first_block = blocks_for(seq.end, block_size), seq.position // block_size
            else:
                needed, first_block = self._check_window(seq, name)
            if len(seq.block_table) < needed:
                raise InvalidStepError(
                    f"{name} needs {needed} KV blocks for positions 0..{seq.end - 1} but its block "
                    f"table has {len(seq.block_table)} (block size {block_size})")
            bad = next((b for b in seq.block_table[:needed] if not 0 <= b < num_blocks), None)
            if bad is not None:
                raise InvalidStepError(f"{name} has block id {bad} outside [0, {num_blocks})")
            if len(set(seq.block_table[:needed])) != needed:
                raise InvalidStepError(f"{name} lists the same KV block twice in its block table")
            for block in seq.block_table[first_block:needed]:
                # Two sequences writing the same block in one step would corrupt each other.
                if block in written:
                    raise InvalidStepError(
                        f"{name} writes KV block {block}, which another sequence writes this step")
                written.add(block)

    def _check_window(self, seq: SequenceWork, name: str) -> tuple[int, int]:
        """A streaming entry's window fits the model and its dropped blocks are ones it no longer
        reads; returns (block table entries it needs, the first it writes)."""
        block_size = self.kv_spec.block_size
        try:
            seq.window.check(self.max_context, block_size)
        except ValueError as exc:
            raise InvalidStepError(f"{name}: {exc}") from None
        dropped = seq.dropped_blocks
        first_read = seq.window.first_kept_block(seq.position, block_size)
        if dropped < 0 or (dropped and first_read <= dropped):
            raise InvalidStepError(f"{name} dropped {dropped} KV blocks but its window still reads "
                                   f"text block {first_read}")
        return (kept_blocks(seq.end, dropped, block_size),
                table_index(seq.position, dropped, block_size))
