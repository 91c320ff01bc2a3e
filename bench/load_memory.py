#!/usr/bin/env python
"""What loading the engine costs in host memory: the process's peak (ru_maxrss) and its resident
size once the engine is ready, per dtype, each in a fresh process (a peak is per process).

The default SmolLM2-135M on CPU with a 16 MiB KV cache and 2 threads; the JSON says which
linear-layer path each engine took. `--compare-moved` also loads it the way the engine did
before the model's weights were packed straight into their buffer (each packed into its own
allocation first, then moved), beside the current way, in the same run.

    python bench/load_memory.py [--dtypes fp32,bf16] [--compare-moved] [--json PATH]
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import cpu_name, make_parser, write_json  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}

# Run in the child: load the engine, then print what it measured as one JSON line.
CHILD = r"""
import contextlib, json, os, resource, sys
from unittest import mock
from services.engine.default_model import default_model_dir
from services.engine.device import set_cpu_threads
from services.engine.engine import Engine, EngineConfig
set_cpu_threads(2)

def packed_then_moved(layers):
    from services.engine.linear_kernel import place_on_huge_pages
    for layer in layers:
        if layer.kernel is not None:
            layer.pack_into(None)
    return place_on_huge_pages(layers)

patch = mock.patch("services.engine.model.place_on_huge_pages", packed_then_moved) if sys.argv[2] == "moved" \
    else contextlib.nullcontext()
with patch:
    engine = Engine(EngineConfig(model_dir=str(default_model_dir()), dtype=sys.argv[1],
                                 kv_cache_bytes=16 << 20, num_threads=2))
resident = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
                  "resident_mb": resident / 1e6, "linear": engine.model.layers[0].qkv.backend}))
"""


def measure(dtype: str, way: str) -> dict:
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", CHILD, dtype, way], capture_output=True, text=True,
                          cwd=root, timeout=600)
    if done.returncode != 0:
        sys.exit(f"loading the {dtype} engine failed: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--compare-moved", action="store_true")
    args = parser.parse_args()
    report = {"cpu": cpu_name(), "threads": 2, "kv_cache_mb": 16}
    ways = ["packed in place"] + (["packed, then moved"] if args.compare_moved else [])
    for name in args.dtypes.split(","):
        for way in ways:
            got = measure(DTYPES[name], "moved" if way == "packed, then moved" else "in place")
            key = name if way == "packed in place" else f"{name}_moved"
            report[key] = got
            print(f"{name} ({way}, linear layers: {got['linear']}): peak {got['peak_mb']:,.0f} MB, "
                  f"resident {got['resident_mb']:,.0f} MB")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
