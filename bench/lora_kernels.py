#!/usr/bin/env python
"""Two ways to add many adapters' LoRA updates to one fused projection in a mixed batch, timed
side by side on this machine (the choice behind services/engine/lora.py):

  grouped   for each adapter present: gather its rows, x A^T over the stacked A of the fused
            parts, then its block-diagonal B, index_add into the output (S-LoRA / Punica's
            grouped path; what the engine does);
  gathered  per token: the token's A and B gathered from stacked [adapters, ...] tensors and two
            batched matmuls over all tokens (BGMV-style, Punica's per-token path).

Shapes of the default model's q/k/v projection (576 -> 960) and MLP down projection (1536 -> 576),
--adapters (4) adapters of --rank (16), rows spread round robin, for a decode step (32 rows) and a
prefill step (512 rows). Both give the same result (checked); time per call, median of --repeats.

    python bench/lora_kernels.py [--json PATH] [--threads 2]

Writes, per case, grouped_us, gathered_us and gathered_over_grouped.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.harness import machine, make_parser, write_json  # noqa: E402
from services.engine.lora import FusedLora, LoraAdapter, LoraBatch  # noqa: E402

CASES = {"qkv": (576, [576, 192, 192]), "down": (1536, [576])}


def make(in_features: int, parts: list[int], adapters: int, rank: int, generator):
    made = []
    for i in range(adapters):
        a = torch.randn(rank * len(parts), in_features, generator=generator) * 0.05
        b = torch.zeros(sum(parts), rank * len(parts))       # block diagonal, as the engine keeps it
        offset = 0
        for j, size in enumerate(parts):
            b[offset:offset + size, j * rank:(j + 1) * rank] = torch.randn(size, rank, generator=generator) * 0.05
            offset += size
        made.append(LoraAdapter(f"a{i}", "", rank, (), [{"f": FusedLora(a, b, 0, sum(parts))}], 0))
    return made


def gathered(x, out, idx, a_stack, b_stack, parts):
    """Per token: its adapter's A and B, gathered, then batched matmuls (rows without an adapter: idx -1)."""
    rows = (idx >= 0).nonzero().squeeze(1)
    sel = idx.index_select(0, rows)
    low = torch.bmm(x.index_select(0, rows).unsqueeze(1), a_stack.index_select(0, sel).transpose(1, 2))  # [R,1,sum r]
    b = b_stack.index_select(0, sel)                                                                       # [R,out,sum r]
    out.index_add_(0, rows, torch.bmm(low, b.transpose(1, 2)).squeeze(1))
    return out


def time_us(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    result = {}
    print(f"{args.adapters} adapters of rank {args.rank}, fp32, {args.threads} threads; {machine()}")
    print(f"{'case':<16}{'grouped':>12}{'gathered':>12}{'gathered / grouped':>20}")
    for name, (in_features, parts) in CASES.items():
        adapters = make(in_features, parts, args.adapters, args.rank, generator)
        out_features = sum(parts)
        # The gathered path's stacks: A [n, sum r, in]; B as one block-diagonal [n, out, sum r].
        a_stack = torch.stack([a.layers[0]["f"].a for a in adapters])
        b_stack = torch.stack([a.layers[0]["f"].b for a in adapters])
        for rows in (32, 512):
            x = torch.randn(rows, in_features, generator=generator)
            base = torch.randn(rows, out_features, generator=generator)
            idx = torch.tensor([i % args.adapters for i in range(rows)])
            batch = LoraBatch([(a, (idx == i).nonzero().squeeze(1)) for i, a in enumerate(adapters)])
            want = batch.apply(0, "f", x, base.clone())
            got = gathered(x, base.clone(), idx, a_stack, b_stack, parts)
            assert torch.allclose(want, got, atol=1e-4), (want - got).abs().max()
            grouped_us = time_us(lambda: batch.apply(0, "f", x, base.clone()), args.repeats)
            gathered_us = time_us(lambda: gathered(x, base.clone(), idx, a_stack, b_stack, parts), args.repeats)
            case = f"{name}, {rows} rows"
            print(f"{case:<16}{grouped_us:>10.0f}µs{gathered_us:>10.0f}µs{gathered_us / grouped_us:>19.2f}x")
            result[f"{name}_{rows}"] = {"grouped_us": grouped_us, "gathered_us": gathered_us,
                                        "gathered_over_grouped": gathered_us / grouped_us}
    result["machine"] = machine()
    write_json(args.json, result)


if __name__ == "__main__":
    main()
