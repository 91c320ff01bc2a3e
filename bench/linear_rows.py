#!/usr/bin/env python
"""The engine's linear kernel (services/engine/kernels/linear.c) of this checkout against another
commit's, by the number of rows it multiplies: a kernel change measured where it acts, before the
engine's paired run (bench/engine_paired.py commit) says what it does to a step.

Both kernels are built with the flags the engine uses and multiply the same weights: every layer
of the model's linear layers (--model's shapes, by default the default model's; random values),
each in its own packed buffer, so that a pass over all layers reads them from memory as a decode
step does (for SmolLM2-135M their bytes are many times the caches). Per row count, --rounds
rounds alternate which kernel runs first, each timing one pass over all layers; the figure is the
mean of the rounds' ratios (other / this, so above 1 is this checkout faster) with a 95% t
interval. The two kernels' outputs are checked to be equal bit for bit at every row count first
(the change must not move a result).

    python bench/linear_rows.py --against HEAD [--dtype bfloat16] [--rows 1,8,16,21,32,64,257]
                                [--rounds 8] [--threads 2] [--model DIR] [--json PATH]
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.engine_paired import this_against_other  # noqa: E402
from bench.harness import machine, make_parser, source_at, write_json  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.engine.default_model import default_model_dir  # noqa: E402
from services.engine.device import set_cpu_threads  # noqa: E402
from services.engine.linear_kernel import SOURCE, LinearKernel, build  # noqa: E402



def kernel_of(commit: str, workdir: Path) -> LinearKernel:
    """The linear kernel as `commit` wrote it, built with this checkout's flags."""
    return LinearKernel(build(source_at(commit, SOURCE, workdir)))


def layer_shapes(config) -> list[tuple[int, int]]:
    """[out, in] of one decoder layer's fused linear layers, as the engine keeps them."""
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    return [(qkv, config.hidden_size), (config.hidden_size, config.num_heads * config.head_dim),
            (2 * config.intermediate_size, config.hidden_size), (config.hidden_size, config.intermediate_size)]


def one_pass(kernel: LinearKernel, layers: list[list[torch.Tensor]], shapes, inputs) -> float:
    started = time.perf_counter()
    for packed in layers:
        for (out_features, _), weight, x in zip(shapes, packed, inputs):
            kernel(x, weight, None, out_features)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--against", default="HEAD", help="the other commit's kernel (default HEAD)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", default="1,8,16,21,32,64,257")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="the model whose shapes to take (default: the default model)")
    args = parser.parse_args(argv)
    set_cpu_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = load_model_config(args.model or default_model_dir())
    shapes = layer_shapes(config)
    with tempfile.TemporaryDirectory() as workdir:
        kernels = {"this": LinearKernel(build()),
                   "other": kernel_of(args.against, Path(workdir))}
    if dtype not in kernels["this"].dtypes:
        raise SystemExit(f"this CPU's kernel does not take {args.dtype}")
    generator = torch.Generator().manual_seed(0)
    layers = [[LinearKernel.pack((torch.randn(n, k, generator=generator) * 0.05).to(dtype)) for n, k in shapes]
              for _ in range(config.num_layers)]
    weight_mb = sum(w.numel() * w.element_size() for packed in layers for w in packed) / 1e6
    print(f"{config.num_layers} layers' linear weights, {weight_mb:.0f} MB {args.dtype}, "
          f"{args.threads} threads; this checkout against {args.against}; other / this time")
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = [torch.randn(rows, k, generator=generator).to(dtype) for _, k in shapes]
        for (n, _), weight, x in zip(shapes, layers[0], inputs):
            if not torch.equal(kernels["this"](x, weight, None, n), kernels["other"](x, weight, None, n)):
                raise SystemExit(f"the kernels' outputs differ at {rows} rows")
        timed = this_against_other(lambda: one_pass(kernels["this"], layers, shapes, inputs),
                                   lambda: one_pass(kernels["other"], layers, shapes, inputs), args.rounds)
        flops = 2 * rows * config.num_layers * sum(n * k for n, k in shapes)
        (low, high), gflops = timed["interval"], flops / timed["this_ms"] / 1e6
        print(f"  {rows:4d} rows: this {timed['this_ms']:7.2f} ms ({gflops:4.0f} GFLOPS), other {timed['other_ms']:7.2f} "
              f"ms; other / this {timed['ratio']:.3f} [{low:.3f}, {high:.3f}]", flush=True)
        results.append({"rows": rows, **timed, "this_gflops": gflops})
    result = {"machine": machine(), "against": args.against, "dtype": args.dtype, "threads": args.threads,
              "layers": config.num_layers, "weight_mb": weight_mb, "results": results}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
