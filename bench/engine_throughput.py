#!/usr/bin/env python
"""Output tokens/s of our engine against Hugging Face transformers generate(), in one run.

Same model folder, same machine, same torch thread count, same device and dtype (fp32 on CPU by
default; `--device cuda --dtype bfloat16` on a GPU), identical prompts and output lengths (EOS cannot end a request early on either side). Two phases:

  b1   the first --requests-b1 requests one at a time (engine: BatchRunner with max_running=1;
       HF: generate() on a batch of one).
  b32  --requests-b32 requests with up to 32 at once (engine: continuous batching, max_running=32;
       HF: static batches of 32 consecutive requests, left-padded, every row generating the
       batch's longest requested output, since that is what static batching does).

tokens/s = requested output tokens (the sum of each request's length; HF's extra tokens in a
static batch are not counted) / wall seconds of the whole phase, prefill included.

    python bench/engine_throughput.py [--json PATH] [--model DIR] [--threads N] [--device cuda] ...
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Run as a script: put the repo root on sys.path, for `services` and `bench.harness`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from bench.harness import cpu_name, make_parser, progress, write_json  # noqa: E402
from services.common.config import DECODE_ATTENTION  # noqa: E402
from services.common.step import SamplingParams  # noqa: E402
from services.engine.batch_runner import BatchRunner, GenerationRequest  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.engine.default_model import default_model_dir  # noqa: E402
from services.engine.device import DTYPES, open_backend, set_cpu_threads  # noqa: E402
from services.engine.engine import Engine, EngineConfig  # noqa: E402
from services.engine.kv_cache import DEFAULT_BLOCK_SIZE, bytes_per_block  # noqa: E402

BATCH = 32                    # concurrency of the b32 phase, both sides
# Engine token budget per step (decodes + prefill chunks). Measured on the default b32 workload
# (2 EPYC cores, engine alone): 128 was ~17% slower; 256, 512, 1024, 2048 and 4096 were all
# within run-to-run noise (46-48 s). 512 fits a whole default-max prompt next to 32 decodes.
ENGINE_MAX_STEP_TOKENS = 512
FIRST_PLAIN_TOKEN_ID = 100    # SmolLM2-style vocabularies keep special tokens (BOS, EOS...) below
PROMPT_RANGE = (16, 256)      # default prompt and output lengths, tokens (--min/--max-prompt, -output)
OUTPUT_RANGE = (16, 128)


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    output_len: int           # exactly this many tokens are generated


def make_workload(count: int, seed: int, vocab: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int]) -> list[Request]:
    """Random-token prompts: the work per token does not depend on the text, and no tokenizer runs."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt = [rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab) for _ in range(rng.randint(*prompt_range))]
        requests.append(Request(prompt, rng.randint(*output_range)))
    return requests


def warmup_workload(seed: int, vocab: int) -> list[Request]:
    """Two tiny requests run before the timed phases (allocator, kernel selection, lazy imports)."""
    return make_workload(2, seed + 1, vocab, (8, 32), (4, 4))


def useful_tokens(requests: list[Request]) -> int:
    return sum(r.output_len for r in requests)


# --- our engine --------------------------------------------------------------------------------

def load_engine(model_dir: str, threads: int, max_prompt: int, max_output: int, device: str,
                dtype: str, decode_attention: str = "auto") -> Engine:
    # Size the KV cache for exactly BATCH worst-case requests rather than a fraction of free
    # memory: BatchRunner admits a request only once its whole KV need is reserved, so too small a
    # cache would silently run fewer than 32 at a time and too large a one only costs RAM.
    per_request = math.ceil((max_prompt + max_output) / DEFAULT_BLOCK_SIZE)
    kv_bytes = BATCH * per_request * bytes_per_block(load_model_config(model_dir), DEFAULT_BLOCK_SIZE,
                                                     DTYPES[dtype])
    return Engine(EngineConfig(model_dir=model_dir, device=device, dtype=dtype,
                               block_size=DEFAULT_BLOCK_SIZE, kv_cache_bytes=kv_bytes,
                               num_threads=threads, decode_attention=decode_attention))


def run_engine(engine: Engine, requests: list[Request], max_running: int,
               bar: tqdm | None = None) -> tuple[float, list[list[int]]]:
    """Wall seconds and output tokens of one BatchRunner.run over all `requests`."""
    runner = BatchRunner(engine, max_running=max_running, max_step_tokens=ENGINE_MAX_STEP_TOKENS)
    batch = [GenerationRequest(r.prompt, SamplingParams(temperature=0.0, max_tokens=r.output_len,
                                                        ignore_eos=True)) for r in requests]
    on_token = (lambda _index, _token: bar.update()) if bar is not None else None
    started = time.perf_counter()
    results = runner.run(batch, on_token=on_token)
    elapsed = time.perf_counter() - started
    outputs = [result.token_ids for result in results]
    for i, (request, output) in enumerate(zip(requests, outputs)):
        if len(output) != request.output_len:   # the comparison would be meaningless
            raise RuntimeError(f"engine gave request {i} {len(output)} tokens, not {request.output_len}")
    return elapsed, outputs


# --- Hugging Face transformers -------------------------------------------------------------------

class _StepProgress(BaseStreamer):
    """Advances the bar each decoding step by the rows still inside their requested length."""

    def __init__(self, bar: tqdm, output_lens: list[int]):
        self.bar, self.output_lens, self.step = bar, output_lens, -1   # the first put is the prompt

    def put(self, value: torch.Tensor) -> None:
        self.step += 1
        if self.step == 0:
            return
        self.bar.update(sum(1 for n in self.output_lens if n >= self.step))

    def end(self) -> None:
        pass


def hf_generate(model, requests: list[Request], pad_id: int,
                bar: tqdm | None = None) -> list[list[int]]:
    """One static batch: left-padded prompts, every row decoding the longest requested length."""
    width = max(len(r.prompt) for r in requests)
    input_ids = torch.full((len(requests), width), pad_id, dtype=torch.long, device=model.device)
    attention_mask = torch.zeros((len(requests), width), dtype=torch.long, device=model.device)
    for row, request in enumerate(requests):
        input_ids[row, width - len(request.prompt):] = torch.tensor(request.prompt)
        attention_mask[row, width - len(request.prompt):] = 1
    new_tokens = max(r.output_len for r in requests)
    streamer = _StepProgress(bar, [r.output_len for r in requests]) if bar is not None else None
    # min_new_tokens = max_new_tokens: EOS can never end a row early, like ignore_eos on our side.
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id,
                         streamer=streamer)
    return [out[row, width:width + r.output_len].tolist() for row, r in enumerate(requests)]


def run_hf(model, requests: list[Request], batch_size: int, pad_id: int,
           bar: tqdm | None = None) -> tuple[float, list[list[int]]]:
    """Wall seconds and output tokens of static batches of `batch_size` consecutive requests."""
    outputs: list[list[int]] = []
    started = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        outputs += hf_generate(model, requests[first:first + batch_size], pad_id, bar)
    return time.perf_counter() - started, outputs


# --- checks and report ---------------------------------------------------------------------------

def compare_greedy(engine_out: list[list[int]], hf_out: list[list[int]], eos_ids: set[int]) -> list[str]:
    """Mismatch descriptions (empty if the two sides agree).

    Compared up to the engine's first EOS only: with ignore_eos the engine may emit EOS as the
    argmax and go on, while HF's min_new_tokens masks EOS and takes the runner-up from there."""
    problems = []
    for i, (ours, theirs) in enumerate(zip(engine_out, hf_out)):
        end = next((pos for pos, token in enumerate(ours) if token in eos_ids), len(ours))
        diff = next((pos for pos in range(end) if ours[pos] != theirs[pos]), None)
        if diff is not None:
            problems.append(f"request {i}: first difference at output token {diff} of {end} compared "
                            f"(engine {ours[diff]}, HF {theirs[diff]})")
    return problems


def print_report(report: dict, seconds: dict) -> None:
    w = report["workload"]
    m = report["machine"]
    print(f"\nmodel {report['model']} | {m['device']} ({m['device_name']}) | CPU {m['cpu']} | "
          f"{report['threads']} threads | torch {m['torch']}, transformers {m['transformers']} | {report['dtype']} | "
          f"decode attention: {report['decode_attention']}")
    print(f"workload: seed {w['seed']}; b1 {w['requests_b1']} requests, b32 {w['requests_b32']} requests; "
          f"prompt {w['prompt_len'][0]}-{w['prompt_len'][1]} tokens, output {w['output_len'][0]}-"
          f"{w['output_len'][1]} tokens (forced); engine max_step_tokens {w['engine_max_step_tokens']}")
    print(f"\n{'phase':<6}{'out tok':>9}{'engine s':>10}{'HF s':>9}{'engine tok/s':>14}{'HF tok/s':>10}"
          f"{'engine/HF':>11}")
    for phase in ("b1", "b32"):
        print(f"{phase:<6}{w[f'useful_tokens_{phase}']:>9}{seconds[f'engine_{phase}']:>10.1f}"
              f"{seconds[f'hf_{phase}']:>9.1f}{report[f'engine_tok_s_{phase}']:>14.1f}"
              f"{report[f'hf_tok_s_{phase}']:>10.1f}{report[f'ratio_{phase}']:>10.2f}x")


def parse_args() -> argparse.Namespace:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--model", help="Hugging Face model folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = all cores)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda[:N] or npu[:N] (both sides)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="both sides")
    parser.add_argument("--decode-attention", default="auto", choices=DECODE_ATTENTION,
                        help="the engine's decode attention: the paged C kernel (CPU) or gather + SDPA")
    parser.add_argument("--requests-b32", type=int, default=64)
    parser.add_argument("--requests-b1", type=int, default=4)
    parser.add_argument("--min-prompt", type=int, default=PROMPT_RANGE[0])
    parser.add_argument("--max-prompt", type=int, default=PROMPT_RANGE[1])
    parser.add_argument("--min-output", type=int, default=OUTPUT_RANGE[0])
    parser.add_argument("--max-output", type=int, default=OUTPUT_RANGE[1])
    args = parser.parse_args()
    if not 1 <= args.min_prompt <= args.max_prompt or not 1 <= args.min_output <= args.max_output:
        parser.error("need 1 <= min <= max for both prompt and output lengths")
    if args.requests_b1 < 1 or args.requests_b32 < 1 or args.threads < 0:
        parser.error("request counts must be >= 1 and --threads >= 0")
    return args


def main() -> None:
    args = parse_args()
    # Before any model loads, so both sides run with the same intra-op thread count.
    threads = set_cpu_threads(args.threads)
    model_dir = args.model or str(default_model_dir())
    config = load_model_config(model_dir)
    if args.max_prompt + args.max_output > config.max_context:
        sys.exit(f"prompt + output of up to {args.max_prompt + args.max_output} tokens exceed the "
                 f"model's {config.max_context}-token context")
    prompt_range, output_range = (args.min_prompt, args.max_prompt), (args.min_output, args.max_output)
    workload = make_workload(max(args.requests_b1, args.requests_b32), args.seed, config.vocab_size,
                             prompt_range, output_range)
    b1, b32 = workload[:args.requests_b1], workload[:args.requests_b32]

    backend = open_backend(args.device)
    print(f"loading {model_dir} on {backend.device} ({backend.name}, {args.dtype}, {threads} threads)",
          file=sys.stderr)
    engine = load_engine(model_dir, threads, args.max_prompt, args.max_output, args.device, args.dtype,
                         args.decode_attention)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[args.dtype]).to(backend.device).eval()
    pad_id = hf.generation_config.pad_token_id
    if pad_id is None:
        pad_id = config.eos_token_ids[0]

    # Warm-up outside the timed phases (allocator, kernel selection, lazy imports in generate()).
    warmup = warmup_workload(args.seed, config.vocab_size)
    print("warming up", file=sys.stderr)
    run_engine(engine, warmup, max_running=2)
    hf_generate(hf, warmup, pad_id)

    seconds, outputs = {}, {}
    for phase, requests, batch in (("b1", b1, 1), ("b32", b32, BATCH)):
        with progress(useful_tokens(requests), f"{'engine ' + phase:<10}", unit="tok") as bar:
            seconds[f"engine_{phase}"], outputs[f"engine_{phase}"] = run_engine(engine, requests, batch, bar)
        with progress(useful_tokens(requests), f"{'HF ' + phase:<10}", unit="tok") as bar:
            seconds[f"hf_{phase}"], outputs[f"hf_{phase}"] = run_hf(hf, requests, batch, pad_id, bar)

    report = {
        "model": Path(model_dir).name,
        "machine": {"cpu": cpu_name(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "device": str(backend.device),
                    "device_name": backend.name},
        "threads": threads, "dtype": args.dtype,
        "decode_attention": "paged C kernel" if engine.decode_kernel is not None else "gather + SDPA",
        "workload": {"seed": args.seed, "requests_b1": len(b1), "requests_b32": len(b32),
                     "prompt_len": list(prompt_range), "output_len": list(output_range),
                     "useful_tokens_b1": useful_tokens(b1), "useful_tokens_b32": useful_tokens(b32),
                     "batch": BATCH, "engine_max_step_tokens": ENGINE_MAX_STEP_TOKENS},
    }
    for phase, requests in (("b1", b1), ("b32", b32)):
        report[f"engine_tok_s_{phase}"] = useful_tokens(requests) / seconds[f"engine_{phase}"]
        report[f"hf_tok_s_{phase}"] = useful_tokens(requests) / seconds[f"hf_{phase}"]
        report[f"ratio_{phase}"] = report[f"engine_tok_s_{phase}"] / report[f"hf_tok_s_{phase}"]
    report.update({f"{k}_seconds": v for k, v in seconds.items()})

    # Sanity check that both sides did the same work: greedy tokens must agree on the b1 requests.
    problems = compare_greedy(outputs["engine_b1"], outputs["hf_b1"], set(config.eos_token_ids))
    report["b1_greedy_match"] = not problems
    print_report(report, seconds)
    for problem in problems:
        print(f"WARNING: engine and HF greedy tokens differ on b1 {problem}")
    if not problems:
        print(f"check: engine greedy tokens equal HF's on all {len(b1)} b1 requests")

    write_json(args.json, report)


if __name__ == "__main__":
    main()
