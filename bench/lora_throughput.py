#!/usr/bin/env python
"""Multi-LoRA throughput: the same load on the engine with no adapter, and spread over 4 adapters
(each request names one, round robin: every step is a mixed batch), in one run.

--requests (64) requests of --prompt-tokens (128) random prompt tokens and --output-tokens (64)
generated tokens each (EOS ignored), up to 32 running at once (BatchRunner, continuous batching),
default model, fp32 CPU, --threads torch threads. The 4 adapters are made with `peft` in a
temporary folder: rank 16 on q, k, v, o, gate, up and down (every projection: the costly case).
The base run goes first and last; its mean is the baseline (this machine is shared and noisy).

    python bench/lora_throughput.py [--json PATH] [--requests 64] [--rank 16]

Writes base_tok_s, lora4_tok_s, ratio (= lora4 / base). Target ratio >= 0.7.
"""
from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.harness import machine, make_parser, write_json  # noqa: E402
from services.common.step import SamplingParams  # noqa: E402
from services.engine.batch_runner import BatchRunner, GenerationRequest  # noqa: E402
from services.engine.default_model import default_model_dir  # noqa: E402
from services.engine.engine import Engine, EngineConfig  # noqa: E402

ADAPTERS = 4
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, folder: Path, rank: int) -> list[Path]:
    import peft
    from transformers import AutoModelForCausalLM
    paths = []
    for i in range(ADAPTERS):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                                          target_modules=ALL_PROJECTIONS))
        model.save_pretrained(folder / f"adapter-{i}")
        paths.append(folder / f"adapter-{i}")
    return paths


def run(engine: Engine, requests: list[GenerationRequest]) -> float:
    started = time.perf_counter()
    results = BatchRunner(engine, max_running=32, max_step_tokens=512).run(requests)
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - started)


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model_dir = default_model_dir(progress=True)
    engine = Engine(EngineConfig(model_dir=str(model_dir), num_threads=args.threads, kv_cache_bytes=512 * 2**20))
    with tempfile.TemporaryDirectory(prefix="qos-lora-bench-") as folder:
        for i, path in enumerate(make_adapters(model_dir, Path(folder), args.rank)):
            engine.load_adapter(f"adapter-{i}", path)
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    prompts = [[rng.randrange(100, engine.model_config.vocab_size) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests)]
    base = [GenerationRequest(p, params) for p in prompts]
    mixed = [GenerationRequest(p, params, lora=f"adapter-{i % ADAPTERS}") for i, p in enumerate(prompts)]
    run(engine, base[:8])                                # warm-up
    base_first = run(engine, base)
    lora = run(engine, mixed)
    base_last = run(engine, base)
    base_tok_s = (base_first + base_last) / 2
    ratio = lora / base_tok_s
    print(f"\n{args.requests} requests x ({args.prompt_tokens} prompt + {args.output_tokens} output tokens), "
          f"32 running; {model_dir.name}, fp32, {args.threads} threads; {machine()}")
    print(f"  base model:           {base_first:7.1f} tok/s, again after: {base_last:7.1f} tok/s")
    print(f"  4 adapters (rank {args.rank}, all 7 projections), mixed in every step: {lora:7.1f} tok/s")
    print(f"  ratio: {ratio:.2f} (target >= 0.7)")
    write_json(args.json, {"base_tok_s": base_tok_s, "lora4_tok_s": lora, "ratio": ratio,
                           "base_tok_s_first": base_first, "base_tok_s_last": base_last, "rank": args.rank,
                           "requests": args.requests, "machine": machine()})


if __name__ == "__main__":
    main()
