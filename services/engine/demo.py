"""Engine demo: the embedded default model answers several chat prompts in one continuous batch.

    python -m services.engine.demo [--model DIR] [--max-tokens N] [--threads N]
"""
from __future__ import annotations

import argparse
import time

from services.common.step import SamplingParams
from services.common.tokenizer import TextTokenizer
from services.engine.batch_runner import BatchRunner, GenerationRequest
from services.engine.default_model import default_model_dir
from services.engine.engine import Engine, EngineConfig

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
    "What does a CPU do?",
    "Suggest a name for a friendly robot.",
    "Why do cats purr?",
    "Summarise the plot of Romeo and Juliet in one sentence.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", help="Hugging Face model folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0 = all cores)")
    args = parser.parse_args()

    model_dir = args.model or str(default_model_dir())
    engine = Engine(EngineConfig(model_dir=model_dir, num_threads=args.threads))
    tokenizer = TextTokenizer.from_model_dir(model_dir)
    print(f"model: {model_dir}\n{engine.kv_spec.describe()}; {engine.threads} CPU threads\n")

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    requests = [GenerationRequest(tokenizer.encode_chat([{"role": "user", "content": p}]), params)
                for p in PROMPTS]
    started = time.perf_counter()
    results = BatchRunner(engine, max_running=len(requests)).run(requests)
    elapsed = time.perf_counter() - started

    for prompt, result in zip(PROMPTS, results):
        print(f"> {prompt}\n{tokenizer.decode(result.token_ids).strip()}\n")
    total = sum(len(r.token_ids) for r in results)
    print(f"{'#':>2} {'prompt tok':>10} {'output tok':>10} {'TTFT ms':>8} {'latency ms':>10} finish")
    for i, (request, result) in enumerate(zip(requests, results)):
        print(f"{i:>2} {len(request.prompt_ids):>10} {len(result.token_ids):>10} "
              f"{result.ttft_seconds * 1000:>8.0f} {result.latency_seconds * 1000:>10.0f} "
              f"{result.finish_reason.value}")
    print(f"\n{len(results)} requests, {total} output tokens in {elapsed:.2f} s "
          f"= {total / elapsed:.1f} tokens/s (greedy, one continuous batch)")


if __name__ == "__main__":
    main()
