#!/usr/bin/env python
"""How often, and how early, a greedy text parts from its undisturbed run, per dtype.

What a fault does to a sequence, done to it on purpose with the engine alone (no cluster): each
prompt's greedy text is made alone, in one batch of its own (the undisturbed run); then again
(1) batched with all the others, prompts chunked into steps of --step-tokens (what a busy pool
does to it), and (2) recomputed from a random point: prompt plus the undisturbed run's first k
tokens prefilled as one prompt, the rest generated from there (what a failover, a preemption or
a migration does). For each dtype it reports how many texts stayed identical, where the others
first part, and whether every stream still continued exactly (bench/continuation.py: each token
the greedy choice after the ones before it).

    python bench/dtype_divergence.py [--prompts 32] [--tokens 48] [--json PATH]

Model: the embedded SmolLM2-135M-Instruct (--model to change), 1 thread. bf16 runs wherever
torch runs it (emulated, and slower, on a CPU without avx512_bf16 or amx_bf16); the figures do
not depend on speed.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.continuation import GreedyChecker, continuity  # noqa: E402
from bench.harness import machine, make_parser, model_or_bench, progress, write_json  # noqa: E402
from services.common.step import SamplingParams  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.engine.batch_runner import BatchRunner, GenerationRequest  # noqa: E402
from services.engine.engine import Engine, EngineConfig  # noqa: E402

SUBJECTS = ("lighthouse", "dragon", "robot", "garden", "river", "violin", "comet", "bakery", "glacier", "train",
            "owl", "desert", "library", "volcano", "kite", "harbour")
ASKS = ("Write a short story about a {}.", "Explain how a {} works.", "List three facts about a {}.",
        "Describe a {} to a child.")


def prompts(count: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(SUBJECTS[(i // len(ASKS) + i) % len(SUBJECTS)]) for i in range(count)]


def measure(model: str, dtype: str, prompt_ids: list[list[int]], tokens: int, step_tokens: int,
            rng: random.Random, bar) -> dict:
    engine = Engine(EngineConfig(model_dir=model, num_threads=1, dtype=dtype, kv_cache_bytes=256 * 2**20))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    alone = []
    for ids in prompt_ids:
        alone.append(BatchRunner(engine, max_running=1, max_step_tokens=4096).run(
            [GenerationRequest(ids, params)])[0].token_ids)
        bar.update()
    batched = [r.token_ids for r in BatchRunner(engine, max_running=len(prompt_ids), max_step_tokens=step_tokens)
               .run([GenerationRequest(ids, params) for ids in prompt_ids])]
    cuts = [rng.randrange(1, tokens) for _ in prompt_ids]
    rest = BatchRunner(engine, max_running=len(prompt_ids), max_step_tokens=step_tokens).run(
        [GenerationRequest(ids + ref[:k], SamplingParams(temperature=0.0, max_tokens=tokens - k, ignore_eos=True))
         for ids, ref, k in zip(prompt_ids, alone, cuts)])
    recomputed = [ref[:k] + r.token_ids for ref, k, r in zip(alone, cuts, rest)]
    bar.update(len(prompt_ids))
    checker = GreedyChecker(model, dtype)
    return {"engine_batch_invariant": engine.batch_invariant,
            "batched": continuity(checker, list(zip(prompt_ids, alone, batched))),
            "recomputed": {**continuity(checker, list(zip(prompt_ids, alone, recomputed))),
                           "cut_at_tokens": cuts}}


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens a text")
    parser.add_argument("--step-tokens", type=int, default=64, help="tokens a step when batched")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--model", default="default", help="model folder (default: the embedded SmolLM2)")
    args = parser.parse_args()
    model = model_or_bench(args.model)
    tokenizer = TextTokenizer.from_model_dir(model)
    prompt_ids = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts(args.prompts)]
    dtypes = args.dtypes.split(",")
    out = {"model": Path(model).name, "prompts": args.prompts, "tokens": args.tokens,
           "step_tokens": args.step_tokens, "seed": args.seed,
           "machine": machine()}
    with progress(2 * args.prompts * len(dtypes), "dtype divergence") as bar:
        for dtype in dtypes:
            out[dtype] = measure(model, dtype, prompt_ids, args.tokens, args.step_tokens,
                                 random.Random(args.seed), bar)
    print(f"\n{args.prompts} prompts x {args.tokens} greedy tokens, {out['model']}; {out['machine']}")
    print(f"{'dtype':<6}{'disturbance':<12}{'identical':>10}{'diverged':>10}{'first at (min/median)':>24}"
          f"{'continuations broken':>22}")
    for dtype in dtypes:
        for kind in ("batched", "recomputed"):
            r = out[dtype][kind]
            first = "-" if not r["texts_diverged"] else \
                f"{r['first_divergence_token_min']} / {r['first_divergence_token_median']}"
            print(f"{dtype:<6}{kind:<12}{r['texts_identical']:>10}{r['texts_diverged']:>10}{first:>24}"
                  f"{r['continuations_broken']:>15} of {r['continuations_checked']}")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
