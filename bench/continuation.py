"""Did a greedy stream continue from exactly the tokens its client already held?

After a failover, preemption, hang, partition or migration the product recomputes a sequence from
its prompt plus every token already streamed and goes on from there. In fp32 on a CPU that gives
the undisturbed run's text token for token (the numbers do not depend on the batch around a
sequence), so tests compare texts. In bf16 (and on every GPU and NPU) a sequence's logits move by
a few units in the last place with the batch around it and with how its prompt was chunked, so a
near-tie can flip and the text may part from the undisturbed one: equality says nothing there.
What still holds in every dtype is checked here, by teacher forcing: each token the client holds
must be the greedy choice given the prompt and the tokens before it, up to the dtype's rounding.
A gap (a token lost) or a repeat (one sent twice) breaks that at the token after it.

    checker = GreedyChecker(model_dir, "bf16")
    checker.broken_at(prompt_ids, token_ids)   # None, or the first index whose token is no greedy choice

The reference is transformers' own implementation, in the same dtype, on the whole sequence at
once (one forward pass per stream). Measured on SmolLM2-135M in bf16, 8 prompts x 48 greedy
tokens, batched and alone (bench/bf16_divergence.py keeps the figures): honest streams fell short
of the top logit by at most 11 bf16 ulps; a token dropped or repeated on purpose by 40 to 660.
TOLERANCE_ULPS sits between. In fp32 the same test holds with a far tighter margin (an fp32 ulp
is 2^16 times smaller), so the bound scales with the dtype's precision.

The random-weight bench model is no use here: its greedy text repeats a token or two, and a
stream with a token dropped is then the same stream. Check streams of a model whose greedy text
varies: SmolLM2, or a random one with weights spread wide enough (tests/e2e/conftest.text_model).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

TOLERANCE_ULPS = 24
# Significant bits of each dtype's mantissa (the ulp at x is 2^(exponent(x) - bits + 1)).
MANTISSA_BITS = {"bfloat16": 8, "float16": 11, "float32": 24}
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32"}


def ulp(value: float, dtype: str) -> float:
    """The spacing of `dtype`'s numbers at |value|."""
    return 2.0 ** (math.floor(math.log2(max(abs(value), 1e-30))) - MANTISSA_BITS[DTYPE_NAMES[dtype]] + 1)


def texts_equal_undisturbed(dtype: str) -> bool:
    """Whether CPU workers in `dtype` ("fp32"/"float32", "bf16"/"bfloat16") with their default
    settings give, on this host, the same greedy text however a sequence is batched, chunked or
    recomputed, so that a disturbed run's texts must equal the undisturbed run's: fp32 yes (its
    roundings are too small to flip a token on the models here, as every fp32 run has shown, and
    where the kernels run they are batch-invariant too); other dtypes where the linear kernel takes
    the dtype and the paged attention kernel builds (services/engine/step_layout.py)."""
    import torch

    from services.engine.step_layout import batch_invariant_on_this_host
    name = DTYPE_NAMES[dtype]
    return name == "float32" or batch_invariant_on_this_host(getattr(torch, name))


class GreedyChecker:
    """Teacher-forced logits of one model in one dtype, to check greedy streams against."""

    def __init__(self, model_dir: str, dtype: str, tolerance_ulps: float = TOLERANCE_ULPS):
        import torch
        from transformers import AutoModelForCausalLM

        self.dtype = DTYPE_NAMES[dtype]
        self.tolerance_ulps = tolerance_ulps
        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, self.dtype))
        self.model.eval()

    def deficits(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> list[float]:
        """For each token: how far its logit falls below the largest at its position, in ulps of
        that largest logit (0 for the greedy choice itself)."""
        torch = self._torch
        with torch.no_grad():
            logits = self.model(torch.tensor([list(prompt_ids) + list(token_ids)])).logits[0].float()
        out = []
        for i, token in enumerate(token_ids):
            row = logits[len(prompt_ids) - 1 + i]
            top = row.max().item()
            out.append((top - row[token].item()) / ulp(top, self.dtype))
        return out

    def broken_at(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> int | None:
        """The first token that is no greedy choice for the text before it, or None."""
        return next((i for i, d in enumerate(self.deficits(prompt_ids, token_ids)) if d > self.tolerance_ulps),
                    None)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one is a prefix of
    the other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def continuity(checker: GreedyChecker, streams: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]]) -> dict:
    """What faults left a set of greedy streams, each given as (prompt ids, the undisturbed run's
    tokens, the tokens its client got): how many continued exactly (every token a greedy choice
    after the ones before it), how many are identical to the undisturbed run, and where the
    others first part from it."""
    broken, diverged = 0, []
    for prompt_ids, reference, got in streams:
        broken += checker.broken_at(prompt_ids, got) is not None
        if (at := first_difference(reference, got)) is not None:
            diverged.append(at)
    return {"dtype": checker.dtype, "continuations_checked": len(streams), "continuations_broken": broken,
            "texts_identical": len(streams) - len(diverged), "texts_diverged": len(diverged),
            "first_divergence_token_min": min(diverged, default=None),
            "first_divergence_token_median": sorted(diverged)[len(diverged) // 2] if diverged else None,
            "tolerance_ulps": checker.tolerance_ulps}
