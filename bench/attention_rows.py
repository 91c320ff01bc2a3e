#!/usr/bin/env python
"""The engine's paged attention kernel (services/engine/kernels/paged_attention.c) of this
checkout against another commit's, by kind of call: a kernel change measured where it acts,
before the engine's paired run (bench/engine_paired.py commit) says what it does to a step.

Both kernels are built with the flags the engine uses and attend the same queries over the same
caches, shaped as the model's (--model; by default the default model's: kv heads, group, head
size), one cache per layer so that a pass over all layers reads the keys and values from memory as
a step does. Where each sequence's blocks lie (--layout): drawn at random from its layer's pool
(scattered, the default), side by side in order (ascending: a fresh pool hands them out so), or
side by side in reverse order (descending). Cases:
  dNxL    N decodes, each over an L-token context
  pTxL    a prompt chunk of T tokens whose last token sees L keys (its first L - T + 1)
With --other-layout, the other side is this checkout's kernel over the same keys and values laid out
another way (a layout measured against another). Per case, --rounds rounds alternate which side
runs first, each timing one pass over all layers; the figure is the mean of the rounds' ratios
(other / this, so above 1 is this side faster) with a 95% t interval. The two sides' outputs are
checked equal bit for bit first.

    python bench/attention_rows.py --against HEAD [--dtype bfloat16] [--cases d1x300,d21x300,...]
                                   [--rounds 8] [--threads 2] [--layout scattered|ascending|descending]
                                   [--other-layout L] [--model DIR] [--json PATH]
"""
from __future__ import annotations

import re
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
from services.engine.kv_cache import DEFAULT_BLOCK_SIZE as BLOCK_SIZE  # noqa: E402
from services.engine.paged_attention import SOURCE, PagedKernel, build_library  # noqa: E402

DEFAULT_CASES = "d1x300,d8x300,d21x300,d32x150,d8x1500,p128x128,p256x256,p32x2048"
LAYOUTS = ("scattered", "ascending", "descending")


def kernel_of(commit: str, workdir: Path) -> PagedKernel:
    """The attention kernel as `commit` wrote it, built with this checkout's flags."""
    return PagedKernel(build_library(source=source_at(commit, SOURCE, workdir)))


def parse_case(case: str) -> tuple[str, int, int]:
    """'d21x300' -> ('d', 21, 300); 'p128x128' -> ('p', 128, 128)."""
    match = re.fullmatch(r"([dp])(\d+)x(\d+)", case)
    if not match or int(match[2]) < 1 or int(match[3]) < (int(match[2]) if match[1] == "p" else 1):
        raise ValueError(f"a case is dNxL (N decodes over L tokens) or pTxL (T prompt tokens, the "
                         f"last seeing L keys, L >= T), not {case!r}")
    return match[1], int(match[2]), int(match[3])


class Case:
    """One case's rows (lengths, queries) and the keys and values of each layer, by sequence and
    block: `placed(layout)` lays them out in a pool."""

    def __init__(self, case: str, config, layers: int, dtype: torch.dtype, generator: torch.Generator):
        kind, count, length = parse_case(case)
        self.sequences, self.blocks_each = (count if kind == "d" else 1), -(-length // BLOCK_SIZE)
        self.chunk = count if kind == "p" else 0
        self.lengths = (torch.full((count,), length, dtype=torch.int64) if kind == "d"
                        else torch.arange(length - count + 1, length + 1, dtype=torch.int64))
        kv, group, d = config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim
        self.q = torch.randn(len(self.lengths), kv, group, d, generator=generator).to(dtype)
        blocks = self.sequences * self.blocks_each        # sequence s's block j is number s * blocks_each + j
        self.contents = [(torch.randn(blocks, kv, d, BLOCK_SIZE, generator=generator).to(dtype),
                          torch.randn(blocks, BLOCK_SIZE, kv, d, generator=generator).to(dtype))
                         for _ in range(layers)]
        self.scale = d ** -0.5
        self.flops = 4 * config.num_heads * d * int(self.lengths.sum()) * layers     # scores + values

    def placed(self, layout: str, generator: torch.Generator) -> "Placed":
        blocks = self.sequences * self.blocks_each
        where = torch.randperm(blocks, generator=generator) if layout == "scattered" else torch.arange(blocks)
        tables = where.view(self.sequences, self.blocks_each)
        if layout == "descending":
            tables = tables.flip(1).contiguous()
        caches = []
        for keys, values in self.contents:
            pool_keys, pool_values = torch.empty_like(keys), torch.empty_like(values)
            pool_keys[tables.flatten()] = keys
            pool_values[tables.flatten()] = values
            caches.append((pool_keys, pool_values.view(-1, *values.shape[2:])))
        if self.chunk:                # the chunk's rows: one table, lengths one apart
            tables = tables.expand(self.chunk, self.blocks_each).contiguous()
        return Placed(self, tables, caches)


class Placed:
    """A case laid out in a pool: its block tables and per-layer caches."""

    def __init__(self, case: Case, tables: torch.Tensor, caches: list):
        self.case, self.tables, self.caches = case, tables, caches

    def run(self, kernel: PagedKernel, layer: int = 0) -> torch.Tensor:
        keys, values = self.caches[layer]
        c = self.case
        return kernel(c.q, keys, values, self.tables, c.lengths, BLOCK_SIZE, c.scale)

    def one_pass(self, kernel: PagedKernel) -> float:
        started = time.perf_counter()
        for layer in range(len(self.caches)):
            self.run(kernel, layer)
        return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--against", default="HEAD", help="the other commit's kernel (default HEAD)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layout", default="scattered", choices=LAYOUTS,
                        help="where each sequence's blocks lie (default: scattered)")
    parser.add_argument("--other-layout", choices=LAYOUTS,
                        help="the other side is this checkout's kernel over the same keys and values "
                             "laid out so (a layout against another), instead of --against's kernel")
    parser.add_argument("--model", default=None, help="the model whose shapes to take (default: the default model)")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    for case in cases:
        try:
            parse_case(case)
        except ValueError as exc:
            parser.error(str(exc))
    set_cpu_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = load_model_config(args.model or default_model_dir())
    with tempfile.TemporaryDirectory() as workdir:
        this = PagedKernel(build_library())
        kernels = {"this": this, "other": this if args.other_layout else kernel_of(args.against, Path(workdir))}
    other_name = f"{args.other_layout} blocks" if args.other_layout else args.against
    print(f"{config.num_layers} layers' caches ({config.num_kv_heads} kv heads x {config.num_heads // config.num_kv_heads}"
          f" queries x {config.head_dim}), {args.dtype}, {args.threads} threads, blocks {args.layout}; "
          f"this checkout against {other_name}; other / this time")
    generator = torch.Generator().manual_seed(0)
    results = []
    for case in cases:
        work = Case(case, config, config.num_layers, dtype, generator)
        placed = {"this": work.placed(args.layout, generator)}
        placed["other"] = work.placed(args.other_layout, generator) if args.other_layout else placed["this"]
        if not torch.equal(placed["this"].run(kernels["this"]), placed["other"].run(kernels["other"])):
            raise SystemExit(f"the outputs differ in case {case}")
        timed = this_against_other(lambda: placed["this"].one_pass(kernels["this"]),
                                   lambda: placed["other"].one_pass(kernels["other"]), args.rounds)
        (low, high), gflops = timed["interval"], work.flops / timed["this_ms"] / 1e6
        print(f"  {case:>10}: this {timed['this_ms']:7.2f} ms ({gflops:4.0f} GFLOPS), other {timed['other_ms']:7.2f} "
              f"ms; other / this {timed['ratio']:.3f} [{low:.3f}, {high:.3f}]", flush=True)
        results.append({"case": case, **timed, "this_gflops": gflops})
        del work, placed
    result = {"machine": machine(), "against": None if args.other_layout else args.against,
              "other_layout": args.other_layout, "dtype": args.dtype, "threads": args.threads,
              "layers": config.num_layers, "layout": args.layout, "block_size": BLOCK_SIZE,
              "results": results}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
