#!/usr/bin/env python
"""Loading a block from the second KV tier against computing it, on this host: the copy of
blocks from the tier back into the pool (GB/s, us per block; in host memory and in a file) and
the engine's prefill (tokens/s at --prompt tokens, so us per block of tokens), per dtype, one
thread. The ratio is how many times cheaper a load is than a recompute: the scheduler loads a
block while it is above 1 (services/scheduler/kv_tier.py, with the worker's own measurement).

    python bench/kv_tier_copy.py [--model default] [--json bench/results/kv_tier_copy.json]
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import machine, make_parser, model_or_bench, write_json  # noqa: E402
from services.common.step import SequenceWork, StepBatch  # noqa: E402
from services.engine.device import set_cpu_threads  # noqa: E402
from services.engine.engine import Engine, EngineConfig  # noqa: E402
from services.engine.kv_tier import KVTier  # noqa: E402


def prefill_us_per_token(engine: Engine, tokens: int, repeats: int) -> float:
    blocks = list(range(-(-tokens // engine.kv_spec.block_size)))
    ids = [(i * 7919) % 5000 + 10 for i in range(tokens)]
    best = float("inf")
    for attempt in range(repeats + 1):
        started = time.perf_counter()
        engine.compute_logits(StepBatch([SequenceWork(attempt, ids, 0, blocks)]))
        if attempt:                                  # the first warms the caches up
            best = min(best, time.perf_counter() - started)
    return best / tokens * 1e6


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    set_cpu_threads(1)
    model = model_or_bench(args.model)
    rows = []
    for dtype in ("float32", "bfloat16"):
        engine = Engine(EngineConfig(model_dir=model, dtype=dtype, kv_cache_bytes=64 << 20, num_threads=1))
        spec = engine.kv_spec
        compute = prefill_us_per_token(engine, args.prompt, args.repeats) * spec.block_size
        with tempfile.TemporaryDirectory() as folder:
            for where, path in (("memory", None), ("file", str(Path(folder) / "tier.bin"))):
                tier = KVTier(engine.cache, 64, path)
                load = min(tier.measure(blocks=64) for _ in range(args.repeats)) * 1e6
                rows.append({"dtype": str(engine.dtype).removeprefix("torch."), "tier": where,
                             "bytes_per_block": spec.bytes_per_block, "load_us_per_block": load,
                             "load_gb_s": spec.bytes_per_block / load / 1e3,
                             "compute_us_per_block": compute, "load_cheaper_x": compute / load})
                print(f"{rows[-1]['dtype']:>9} {where:<6} load {load:8.1f} us/block ({rows[-1]['load_gb_s']:.1f} GB/s), "
                      f"compute {compute:9.1f} us/block: a load is {compute / load:,.0f}x cheaper")
    write_json(args.json, {"machine": machine(), "model": Path(model).name, "prompt_tokens": args.prompt,
                           "threads": 1, "load_average": os.getloadavg(), "rows": rows})


if __name__ == "__main__":
    main()
