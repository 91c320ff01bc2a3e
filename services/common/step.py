"""What the scheduler asks a worker to compute in one step, and what comes back.

Plain dataclasses with no torch import: the scheduler builds them, the worker's engine consumes
them. Positions of a sequence's tokens in a step are contiguous, so a step entry carries the
position of its first token.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from services.common.proto.qos.v1 import common_pb2
from services.common.stream_window import StreamWindow


class FinishReason(IntEnum):
    """Why a sequence ended: the wire enum qos.v1.FinishReason, value for value, on every hop
    (engine -> worker -> scheduler -> router -> client)."""
    STOP = common_pb2.FINISH_REASON_STOP        # EOS, a stop token or a stop string
    LENGTH = common_pb2.FINISH_REASON_LENGTH    # max_tokens reached, or the context window is full
    # The sequence's grammar (a structured output's schema) allows no next token: engine to
    # scheduler only, with a token that is not sent; the scheduler fails the request instead.
    ERROR = common_pb2.FINISH_REASON_ERROR

    @property
    def label(self) -> str:
        """"stop" or "length", as OpenAI's API and our logs name it."""
        return self.name.lower()


MAX_TOP_LOGPROBS = 20    # top tokens a sequence may ask logprobs of (OpenAI's bound)
MAX_LOGIT_BIAS = 1024    # tokens a sequence may bias (each costs the sampler a little, every step)
MAX_ALLOWED_TOKEN_IDS = 4096   # tokens a sequence may restrict its sampling to (vLLM has no bound; ours is cost)
MAX_BAD_WORDS = 64            # words a request may forbid (each checked against its output, every step)
MAX_BAD_WORD_CHARS = 256
PENALTY_RANGE = (-2.0, 2.0)          # presence and frequency penalties (OpenAI's bounds)
MAX_REPETITION_PENALTY = 10.0        # > 0; 1 is none (vLLM's meaning); more only pushes logits to 0 or -inf
LOGIT_BIAS_RANGE = (-100.0, 100.0)   # OpenAI's bounds
GUIDES = ("json_schema", "regex", "choice", "grammar")   # structured outputs' kinds, at most one a sequence


def guides_set(sampling) -> list[str]:
    """The structured-output kinds a sampling sets (SamplingParams, or either proto's), in GUIDES' order."""
    return [name for name in GUIDES if getattr(sampling, name)]


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 1.0          # 0 means greedy
    top_k: int = 0                    # 0 disables top-k
    top_p: float = 1.0                # 1.0 disables nucleus sampling
    seed: int | None = None           # same seed, same tokens, whatever else is in the batch
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()   # stop on these in addition to the model's EOS ids
    ignore_eos: bool = False          # benchmarks: keep going past EOS (stop_token_ids still stop)
    logprobs: int | None = None       # set: each token's logprob and this many top ones (0-MAX_TOP_LOGPROBS)
    json_schema: str = ""             # structured output: a JSON Schema (JSON text) the output must match
    # ... or, at most one of them (services/common/grammar.py): a regular expression it matches,
    # strings it is exactly one of, a context-free grammar (Lark or GBNF) it follows.
    regex: str = ""
    choice: tuple[str, ...] = ()
    grammar: str = ""
    # Adjustments of the logits before sampling (services/engine/sampler.py, in vLLM's order and
    # with its formulas): every token but the allowed ones off (none given: all allowed; kept as
    # sent, so a duplicate counts toward the bound); a bias per token; a penalty on tokens of the
    # prompt or output (repetition: positive logits divided by it, negative ones multiplied); on
    # output tokens by their count (frequency) and for being there at all (presence); then, after
    # temperature, dropping tokens less likely than min_p times the likeliest.
    allowed_token_ids: tuple[int, ...] = ()
    # Forbidden words as token sequences (vLLM's bad_words, tokenized at the scheduler): a one-token
    # word is never sampled, a longer one's last token not when the output ends with the rest.
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # Locally typical sampling (TGI's typical_p): after top-k/top-p, only the tokens whose -log p is
    # closest to the entropy, the fewest making up this much of the probability; 1: none.
    typical_p: float = 1.0
    # Output tokens before EOS or a stop token id may be sampled (their logits are -inf until
    # then) and before a stop string counts (vLLM's min_tokens).
    min_tokens: int = 0
    # Set: each prompt token's logprob given the tokens before it, and this many top ones
    # (0-MAX_TOP_LOGPROBS): a completion's `echo` with `logprobs` (SequenceWork.prompt_targets).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:   # also catches NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_TOP_LOGPROBS}, got {getattr(self, name)}")
        guides = guides_set(self)
        if len(guides) > 1:
            raise ValueError(f"{guides[1]} and {guides[0]} both say what the output is: set one of them")
        if guides and self.ignore_eos:
            raise ValueError(f"ignore_eos cannot be combined with {guides[0]}: a structured answer ends "
                             "where it is complete")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1: none), "
                             f"got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0, 1] (1: none), got {self.typical_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.min_tokens and guides:
            raise ValueError(f"min_tokens cannot be combined with {guides[0]}: a structured answer ends "
                             "where it is complete")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        low, high = LOGIT_BIAS_RANGE
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not low <= bias <= high:
                raise ValueError(f"logit_bias[{token_id}] must be a token id >= 0 with a bias in "
                                 f"[{low:g}, {high:g}], got {bias}")
        self._check_allowed_token_ids(guides)
        self._check_bad_words(guides)

    def _check_bad_words(self, guides: list[str]) -> None:
        words = self.bad_words_ids
        if len(words) > 2 * MAX_BAD_WORDS:        # each word, and after a space
            raise ValueError(f"bad_words may name at most {MAX_BAD_WORDS} words, got {len(words)} token sequences")
        if any(not word or len(word) > MAX_BAD_WORD_CHARS or min(word) < 0 for word in words):
            raise ValueError(f"bad_words must be 1 to {MAX_BAD_WORD_CHARS} token ids >= 0 each")
        if words and (guides or self.allowed_token_ids):
            other = guides[0] if guides else "allowed_token_ids"
            raise ValueError(f"bad_words and {other} both say which tokens may come: set one of them")

    def _check_allowed_token_ids(self, guides: list[str]) -> None:
        # Messages start with the field's name: the router reports the first word as the field.
        allowed = self.allowed_token_ids
        if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"allowed_token_ids may name at most {MAX_ALLOWED_TOKEN_IDS} tokens, got {len(allowed)}")
        if allowed and min(allowed) < 0:
            raise ValueError(f"allowed_token_ids must be token ids >= 0, got {min(allowed)}")
        if allowed and guides:
            raise ValueError(f"allowed_token_ids and {guides[0]} both say which tokens may come: set one of them")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        """A structured output: a grammar decides which tokens may come next."""
        return bool(guides_set(self))

    @property
    def penalised(self) -> bool:
        """Some adjustment applies to its logits before the sampling (not min_p, which comes after)."""
        return bool(self.allowed_token_ids) or bool(self.bad_words_ids) or bool(self.logit_bias) \
            or bool(self.presence_penalty) or bool(self.frequency_penalty) or self.repetition_penalty != 1.0


GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class SequenceWork:
    """One sequence's share of a step."""
    seq_id: int
    token_ids: list[int]              # tokens to compute now (a prefill chunk, or the last token)
    position: int                     # position of token_ids[0]; the rest follow contiguously
    block_table: list[int]            # KV block ids covering positions 0 .. position+len-1 (dense)
    sampling: SamplingParams = GREEDY
    num_generated: int = 0            # output tokens the sequence already has
    sample: bool = True               # False for a prefill chunk that does not end the prompt
    lora: str = ""                    # the LoRA adapter its projections add ("": the base model)
    # Streaming mode (services/common/stream_window.py): the window it attends, and how many of its
    # text blocks after the sink block were dropped from the front of block_table. None: dense.
    window: StreamWindow | None = None
    dropped_blocks: int = 0
    # Structured output: its grammar state (an llguidance matcher, services/engine/grammar.py), which
    # masks the token sampled at the end of this entry and advances by it. None: unconstrained.
    constraint: object = None
    # The sequence's tokens so far, prompt then output from `output_start` (a resumed request's
    # streamed tokens are output): what its penalties count. Read only when it samples this step.
    history: Sequence[int] = ()
    output_start: int = 0
    # With sampling.prompt_logprobs: the prompt tokens that follow this entry's tokens, one per
    # row from the first (the last row's target is the next chunk's first token; a final chunk's
    # last row samples instead). Their logprobs come back in StepOutput.prompt_logprobs.
    prompt_targets: Sequence[int] = ()

    @property
    def end(self) -> int:
        """One past the last position computed this step."""
        return self.position + len(self.token_ids)


@dataclass(slots=True)
class StepBatch:
    sequences: list[SequenceWork] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability, and the most likely tokens' (id, logprob), best first."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0           # a prompt token's 1-based rank by logprob in the vocabulary (0: not computed)


@dataclass(slots=True, frozen=True)
class SampledToken:
    seq_id: int
    token_id: int
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprobs | None = None      # only for a sequence whose sampling asks


@dataclass(slots=True, frozen=True)
class PromptLogprobs:
    """Prompt tokens' logprobs (SequenceWork.prompt_targets): `entries[i]` is the token at
    position `first_position + i`, given the tokens before it."""
    seq_id: int
    first_position: int
    token_ids: tuple[int, ...]
    entries: tuple[TokenLogprobs, ...]


@dataclass(slots=True)
class StepOutput:
    tokens: list[SampledToken]
    forward_seconds: float            # model forward + sampling wall time
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
