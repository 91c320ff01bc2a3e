"""Structured outputs in the engine: each constrained sequence's grammar state (an llguidance
matcher) and the token masks applied to its logits before sampling.

A sequence's grammar state is derived from its tokens: the worker builds its matcher from the
request's schema, regex, choices or grammar (services/common/grammar.py) and advances it over the
tokens generated so far, so a sequence announced again after a preemption, a failover or a
migration (its prompt carries them, NewSequence.num_generated counts them) continues exactly
where it was. After each sampled
token the engine advances it by that token.

The masks are computed on a helper thread while the step's forward pass runs (`start_masks`,
before the forward) where the forward leaves a core for it
(`overlap_masks`), else once the logits exist; either way they are added to the sampled rows of
the logits (`StepMasks.apply`): an unconstrained sequence's row is never touched, whatever else
shares its batch. A matcher reports the EOS tokens allowed only where the grammar accepts
what came before, so a sequence ends (finish_reason "stop") only with a complete answer; one
whose max_tokens runs out first ends "length", its answer incomplete, as OpenAI's does. A matcher
that fails (a schema llguidance compiles but cannot follow: a recursion that never ends, a pattern
too large) ends its sequence with FinishReason.ERROR, never "stop": the scheduler fails the
request, naming the schema.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from services.common.grammar import FIRST_MASK_FUEL, grammar_for
from services.common.step import SamplingParams, SequenceWork
from services.engine.config import ModelConfig

log = logging.getLogger(__name__)

_MASKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
# The bias of each byte of a bitmask: 8 floats, 0.0 for a set bit (allowed), -inf for a clear one.
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"),
                      np.float32(0), np.float32(-np.inf)).astype(np.float32)


class Grammars:
    """Matchers for one model: its tokenizer's tables, built at the first constrained sequence."""

    def __init__(self, model_dir: str | Path, config: ModelConfig, overlap: bool = True):
        self.model_dir = Path(model_dir)
        self.vocab_size = config.vocab_size
        self.eos_token_ids = list(config.eos_token_ids)
        # Masks computed on the helper thread during the forward pass: only where the forward
        # leaves a core free for it (see overlap_masks).
        self.overlap = overlap
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer
                self._tokenizer = LLTokenizer((self.model_dir / "tokenizer.json").read_text(),
                                              n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            return self._tokenizer

    def matcher(self, sampling: SamplingParams, generated: list[int]):
        """A matcher for a constrained sequence's grammar, advanced over the tokens it generated
        so far. One that cannot be built or refuses those tokens is kept in its error state: its
        sequence then ends with FinishReason.ERROR at its next sampled token (StepMasks.failed)."""
        from llguidance import LLMatcher, LLParserLimits
        try:
            grammar = grammar_for(sampling)
        except ValueError as exc:       # the scheduler compiled it; should one still fail here,
            grammar = str(exc)          # it is no grammar text: the matcher starts in its error state
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0,
                            limits=LLParserLimits(initial_lexer_fuel=FIRST_MASK_FUEL))
        if generated and not matcher.is_error():
            matcher.consume_tokens(generated)
        return matcher

    def start_masks(self, sampled: list[SequenceWork]) -> StepMasks | None:
        """Begin computing the masks of the sampled entries that have a grammar (None: none has)."""
        rows = [i for i, work in enumerate(sampled) if work.constraint is not None]
        if not rows:
            return None
        return StepMasks(rows, [sampled[i].constraint for i in rows], self.vocab_size, self.eos_token_ids,
                         self.overlap)


def _reason(error: str) -> str:
    """llguidance's error line (its message goes on with the parser's state and the grammar)."""
    return next((line for line in error.splitlines() if line.startswith("Error:")), error[:200])


def overlap_masks(device: torch.device, threads: int) -> bool:
    """Whether to compute masks on the helper thread while the forward pass runs: yes where the
    forward runs on an accelerator, or on fewer CPU threads than the cores this process may use.
    Where torch's threads take every core, the helper thread can only run by descheduling one of
    them, and each of the forward's parallel regions waits for the slowest thread. On this 2-core
    host (bench/grammar_mask_cost.py, bf16, batch 32) the helper thread hid the masks' 3-4 ms a
    step (the step waited 0.02 ms for them), but with torch on both cores its decode tok/s was
    not better than computing them after the forward (0.956 against 0.970 of free decoding, 6
    rounds; intervals of +-0.13, the host shared)."""
    return device.type != "cpu" or threads < len(os.sched_getaffinity(0))


class StepMasks:
    """The masks of one step's constrained rows, being computed; apply() waits for them.

    The helper thread turns llguidance's bitmask into an additive bias, 0 where a token is allowed
    and -inf where not (a table of 8 floats per byte value: 14 us a row here, 284 us for 32), so
    that the step's own path adds it to the logits in one op (12 us for a row, 205 us for 32, one
    thread; a boolean masked_fill took 80 us and 6.7 ms)."""

    def __init__(self, rows: list[int], matchers: list, vocab_size: int, eos: list[int], overlap: bool = True):
        self.rows, self.matchers = rows, matchers
        self.vocab_size, self.eos = vocab_size, eos
        self.bias: np.ndarray | None = None
        self.failed: set[int] = set()        # rows whose matcher failed: their sequences end in ERROR
        self.row_index = torch.tensor(rows)
        self.ready: Future | None = _MASKS.submit(self._fill) if overlap else None   # None: at apply()

    def _fill(self) -> None:
        bitmask = np.empty((len(self.rows), (self.vocab_size + 31) // 32), dtype=np.int32)
        row_bytes = bitmask.shape[1] * 4
        for i, matcher in enumerate(self.matchers):
            target = bitmask[i]
            if not matcher.is_error():
                matcher.unsafe_compute_mask_ptr(target.ctypes.data, row_bytes)
            if matcher.is_error():       # the sequence ends (FinishReason.ERROR); any token will do
                self.failed.add(self.rows[i])
                log.warning("a grammar matcher failed; its sequence ends in error: %s", _reason(matcher.get_error()))
                words = target.view(np.uint32)
                words[:] = 0
                for token in self.eos:
                    words[token // 32] |= np.uint32(1 << (token % 32))
        rows = len(self.rows)
        self.bias = np.take(_BYTE_BIAS, bitmask.view(np.uint8), axis=0).reshape(rows, -1)[:, :self.vocab_size]

    @torch.inference_mode()      # the logits are the forward pass's inference tensors: changed in place
    def apply(self, logits: torch.Tensor) -> None:
        """-inf on every token the grammar does not allow next, in the constrained rows of logits
        [sampled rows, vocab] (in place)."""
        if self.ready is None:
            self._fill()
        else:
            self.ready.result()
        device = logits.device
        logits.index_add_(0, self.row_index.to(device), torch.from_numpy(self.bias).to(device))

    def advance(self, token_ids: list[int]) -> None:
        """Each constrained row's sampled token into its matcher (token_ids: one per sampled row)."""
        for row, matcher in zip(self.rows, self.matchers):
            if not matcher.is_error():
                matcher.consume_token(token_ids[row])
