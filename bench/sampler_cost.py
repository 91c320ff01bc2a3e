#!/usr/bin/env python
"""The sampler of this checkout (services/engine/sampler.py) against a commit's, on real logits:
what a sampled step's draw costs, apart from the model.

The logits are the default model's own (fp32) at every position of a prose text (this
repository's README), --rows of them picked at random: a nucleus on prose is what API traffic
samples from, where random logits would make every row nearly flat. For each sampling setting
(greedy, temperature alone, with top-p, with top-k, seeded), --rounds rounds alternate which
sampler runs first, each timing one `sample` call over the rows; the figure is the mean of the
rounds' ratios (other / this, above 1 is this checkout faster) with a 95% t interval. Also each
setting's nucleus sizes (tokens kept by top-p), the reason the sampler sorts few tokens first.

    python bench/sampler_cost.py --against 952cfc4 [--rows 32] [--rounds 12] [--threads 2] [--json PATH]
"""
from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.engine_paired import this_against_other  # noqa: E402
from bench.harness import machine, make_parser, source_at, write_json  # noqa: E402
from services.common.step import SamplingParams, SequenceWork, StepBatch  # noqa: E402
from services.common.tokenizer import TextTokenizer  # noqa: E402
from services.engine import sampler  # noqa: E402
from services.engine.default_model import default_model_dir  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.engine.device import set_cpu_threads  # noqa: E402
from services.engine.engine import Engine, EngineConfig  # noqa: E402
from services.engine.kv_cache import DEFAULT_BLOCK_SIZE, bytes_per_block  # noqa: E402

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1.0": SamplingParams(temperature=1.0),
    "temperature 0.7, top_p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "temperature 1.0, top_p 0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "temperature 0.8, top_k 50": SamplingParams(temperature=0.8, top_k=50),
    "temperature 0.7, top_p 0.9, seeded": SamplingParams(temperature=0.7, top_p=0.9, seed=5),
}
TEXT_TOKENS = 1000


def sampler_of(commit: str, workdir: Path):
    """services/engine/sampler.py as `commit` wrote it, imported beside this checkout's."""
    path = source_at(commit, Path(sampler.__file__), workdir)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prose_logits() -> torch.Tensor:
    """[TEXT_TOKENS, vocab]: the default model's logits at each position of the README's text."""
    model_dir = default_model_dir()
    ids = TextTokenizer.from_model_dir(model_dir).encode(
        (Path(__file__).resolve().parent.parent / "README.md").read_text())[:TEXT_TOKENS]
    blocks = (len(ids) + DEFAULT_BLOCK_SIZE - 1) // DEFAULT_BLOCK_SIZE
    kv_bytes = blocks * bytes_per_block(load_model_config(model_dir), DEFAULT_BLOCK_SIZE, torch.float32)
    engine = Engine(EngineConfig(model_dir=str(model_dir), dtype="float32", block_size=DEFAULT_BLOCK_SIZE,
                                 kv_cache_bytes=kv_bytes, num_threads=torch.get_num_threads()))
    return engine.compute_logits(StepBatch([SequenceWork(1, ids, 0, list(range(blocks)))]))[1]


def nucleus_sizes(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    """Tokens top-p keeps in each row (the median, 90th and 99th percentiles)."""
    probs = (logits / params.temperature).softmax(dim=-1).sort(dim=-1, descending=True).values
    sizes = ((probs.cumsum(dim=-1) - probs) < params.top_p).sum(dim=-1).float()
    return [int(v) for v in sizes.quantile(torch.tensor([0.5, 0.9, 0.99])).tolist()]


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--against", default="HEAD", help="the other commit's sampler (default HEAD)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    set_cpu_threads(args.threads)
    with tempfile.TemporaryDirectory() as workdir:
        other = sampler_of(args.against, Path(workdir))
    every = prose_logits()
    rows = every[torch.randperm(len(every), generator=torch.Generator().manual_seed(0))[:args.rows]].contiguous()
    print(f"{args.rows} rows of the default model's logits on prose, {args.threads} threads; this checkout "
          f"against {args.against}; other / this time")
    results = []
    for label, params in SETTINGS.items():
        generator = torch.Generator().manual_seed(0)
        batch, generated = [params] * args.rows, list(range(args.rows))

        def timed(module):
            started = time.perf_counter()
            module.sample(rows, batch, generated, generator)
            return time.perf_counter() - started

        result = this_against_other(lambda: timed(sampler), lambda: timed(other), args.rounds)
        if params.top_p < 1.0:
            result["nucleus_p50_p90_p99"] = nucleus_sizes(every, params)
        low, high = result["interval"]
        print(f"  {label:36s} this {result['this_ms']:7.2f} ms, other {result['other_ms']:7.2f} ms; "
              f"other / this {result['ratio']:.2f} [{low:.2f}, {high:.2f}]"
              + (f"; nucleus p50/p90/p99 {result['nucleus_p50_p90_p99']}" if "nucleus_p50_p90_p99" in result else ""),
              flush=True)
        results.append({"setting": label, **result})
    report = {"machine": machine(), "against": args.against, "rows": args.rows, "threads": args.threads,
              "results": results}
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
