#!/usr/bin/env python
"""What a grammar mask costs a decode step, paired: decode tokens/s of the same workload with every
sequence under a JSON Schema against none, on one engine, alternating which goes first.

Each round runs BATCH sequences (random 128-token prompts) for GEN tokens each, greedy, three
times, in a rotating order: free (ignore_eos); constrained by SCHEMA (an object holding an array
of at least 500 strings: a real JSON mask at every token, strings, separators and all, and never
complete, so every side generates exactly GEN tokens) with the masks computed on the helper
thread while the forward pass runs ("thread"); and constrained with the masks computed once the
logits exist, on the step's path ("inline"). The engine picks one of the two by
grammar.overlap_masks (the helper thread only where the forward leaves a core free); the JSON
says which it picks for the run's device and threads. The figures are each round's ratios of
decode-only tokens/s, thread / free and inline / free, as bench/engine_paired.py pairs engine
changes: the mean with a 95% t interval.

Also, per step, where the mask's time goes (the constrained runs): `fill` (llguidance computing
the masks and turning them into a bias), `wait` (what the step waited for them once its logits
existed: all of `fill` inline, the part not hidden on the helper thread), `apply` (adding the bias
to the logits) and `advance` (each sampled token into its matcher).

    python bench/grammar_mask_cost.py [--batches 1,32] [--rounds 6] [--gen 64] [--threads 2] [--json PATH]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_paired import mean_interval  # noqa: E402
from bench.engine_workload import load_engine, make_workload  # noqa: E402
from bench.engine_vs_llamacpp import TimedSteps  # noqa: E402
from bench.harness import cpu_name, make_parser, write_json  # noqa: E402
from services.common.step import SamplingParams  # noqa: E402
from services.engine import grammar  # noqa: E402
from services.engine.grammar import overlap_masks  # noqa: E402
from services.engine.batch_runner import BatchRunner, GenerationRequest  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.engine.default_model import default_model_dir  # noqa: E402
from services.engine.device import CpuBackend, set_cpu_threads  # noqa: E402

SCHEMA = json.dumps({"type": "object", "properties": {"notes": {
    "type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 500}},
    "required": ["notes"], "additionalProperties": False})


class Done:
    """A finished job (the inline side's masks, filled while timing the wait)."""

    def result(self):
        return None


DONE = Done()


class MaskTimes:
    """Wraps StepMasks to time its parts (seconds a step), for the side being run (`side`)."""

    def __init__(self):
        self.side = "thread"
        self.times = {side: {part: [] for part in ("fill", "wait", "apply", "advance")} for side in ("thread", "inline")}
        self.original = (grammar.StepMasks._fill, grammar.StepMasks.apply, grammar.StepMasks.advance)

    def install(self) -> None:
        fill, apply, advance = self.original

        def timed(part, fn):
            def run(masks, *args):
                started = time.perf_counter()
                if part == "apply":       # the wait for the masks, apart from applying them
                    if masks.ready is None:
                        masks._fill()
                        masks.ready = DONE
                    else:
                        masks.ready.result()
                    self.times[self.side]["wait"].append(time.perf_counter() - started)
                    started = time.perf_counter()
                fn(masks, *args)
                self.times[self.side][part].append(time.perf_counter() - started)
            return run
        grammar.StepMasks._fill = timed("fill", fill)
        grammar.StepMasks.apply = timed("apply", apply)
        grammar.StepMasks.advance = timed("advance", advance)

    def summary(self, side: str) -> dict:
        return {f"{part}_us_median": statistics.median(values) * 1e6 for part, values in self.times[side].items()}


TIMES = MaskTimes()
SIDES = ("free", "thread", "inline")


def decode_tok_s(engine, workload, batch: int, side: str) -> dict:
    engine.grammars.overlap = side == "thread"
    TIMES.side = side
    constrained = side != "free"
    timed = TimedSteps(engine)
    params = (SamplingParams(temperature=0.0, max_tokens=workload[0].output_len, json_schema=SCHEMA) if constrained
              else SamplingParams(temperature=0.0, max_tokens=workload[0].output_len, ignore_eos=True))
    results = BatchRunner(timed, max_running=batch, max_step_tokens=max(512, batch)).run(
        [GenerationRequest(r.prompt, params) for r in workload])
    assert all(len(r.token_ids) == workload[0].output_len for r in results)
    decode = [(s, n) for s, only, n in timed.steps if only]
    return {"tok_s": sum(n for _, n in decode) / sum(s for s, _ in decode), "decode_steps": len(decode)}


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default=None, help="default: the host's choice (bf16 with native bf16)")
    args = parser.parse_args()
    threads = set_cpu_threads(args.threads)
    model_dir = str(default_model_dir())
    config = load_model_config(model_dir)
    dtype = args.dtype or ("bfloat16" if CpuBackend().preferred_dtype == torch.bfloat16 else "float32")
    engine = load_engine(model_dir, threads, args.prompt, args.gen, "cpu", dtype)
    TIMES.install()
    report = {"model": Path(model_dir).name, "cpu": cpu_name(), "dtype": str(engine.dtype).removeprefix("torch."),
              "threads": threads, "engine_picks": "thread" if overlap_masks(engine.device, threads) else "inline",
              "prompt_tokens": args.prompt, "generated_tokens": args.gen, "schema": SCHEMA,
              "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        workload = make_workload(batch, args.seed, config.vocab_size, (args.prompt,) * 2, (args.gen,) * 2)
        for side in SIDES:           # warm-up: kernel choice, the tokenizer's tables
            decode_tok_s(engine, workload[:2], min(batch, 2), side)
        TIMES.times = MaskTimes().times
        rounds = []
        for number in range(args.rounds):
            order = SIDES[number % 3:] + SIDES[:number % 3]
            runs = {}
            for side in order:
                load = os.getloadavg()[0]
                runs[side] = decode_tok_s(engine, workload, batch, side)
                runs[side]["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]
            for side in ("thread", "inline"):
                runs[f"{side}_ratio"] = runs[side]["tok_s"] / runs["free"]["tok_s"]
            rounds.append(runs)
            print(f"batch {batch} round {number + 1}/{args.rounds}: " + ", ".join(
                f"{side} {runs[side]['tok_s']:.1f}" for side in SIDES) + " tok/s", file=sys.stderr)
        figures = {"parts": {side: TIMES.summary(side) for side in ("thread", "inline")}, "rounds": rounds}
        for side in ("thread", "inline"):
            mean, low, high = mean_interval([r[f"{side}_ratio"] for r in rounds])
            figures[f"{side}_ratio"] = {"mean": mean, "ci95": [low, high]}
            print(f"batch {batch}: {side} / free decode tok/s {mean:.3f}, 95% interval [{low:.3f}, {high:.3f}] "
                  f"over {args.rounds} rounds")
        print(f"batch {batch}: the mask's parts, median us a step: {figures['parts']}")
        report["batches"][str(batch)] = figures
        write_json(args.json, report)


if __name__ == "__main__":
    main()
