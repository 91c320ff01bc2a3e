#!/usr/bin/env python
"""One engine change, on against off, paired: did it make decoding (or prompts) faster on this host?

Both engines live in one process (same weights, threads, requests); each pair runs the same
workload on each, alternating which goes first, and the figure is the pair's ratio of decode
tokens/s, on / off (decode-only steps, as bench/engine_vs_llamacpp.py counts them), or for a
change to prompts, of prompt tokens/s (tokens computed in the steps that are not decode-only). A
shared host's load moves both runs of a pair alike, so the ratio is steadier than either run.
Reported: the mean ratio with a 95% t interval over the pairs; a change is kept only where the
interval lies wholly above 1.

Changes (the "off" engine is the code as it was, rebuilt by this script, not a product switch;
one tried and not kept, bf16 RMSNorm through the fused fp32 kernel, is in
bench/results/engine_paired_bf16_norm_b1.json):
  bf16-prepack   bf16 linear layers on oneDNN with prepacked weights (off: F.linear)
  linear-kernel  linear layers on the engine's C kernel (services/engine/linear_kernel.py; off:
                 oneDNN with prepacked weights, as before it), in the dtype given (default bf16)
  huge-pages     the C kernel's packed weights in one buffer on 2 MiB pages (off: each in its own
                 allocation), in the dtype given (default bf16)
  bf16-kernel    bf16 decodes attended by the paged C kernel (off: gather + SDPA; tried
                 first at 62beec6, bench/results/engine_paired_bf16_kernel*.json)
  fused-layer    decode-only steps' layers in one C call each (services/engine/decode_layer.py;
                 off: torch's operations around the same kernels), in the dtype given (default bf16)
  fused-prompts  steps with prompt chunks in the same C layer (off: the layer for decode-only
                 steps, torch's operations for the others); prompt tokens/s
  (batch-invariant, decodes attended by the prompt kernel rather than a decode kernel of their
                 own, was a change here until one kernel took both: its pairs are in
                 bench/results/engine_paired_batch_invariant*.json)
  prompt-kernel  prompt chunks attended by the paged kernel (EngineConfig.prompt_attention;
                 off: SDPA over the gathered context); prompt tokens/s
  commit         this checkout's engine (on) against another commit's (off: --against, checked out
                 into a git worktree under /tmp/qos-paired), for a change no switch turns off (a
                 cache layout); each side runs in a process of its own, kept between runs.
                 Decode tokens/s, or prompt tokens/s with --figure prefill_tok_s. With --as-host
                 avx2 (or none), both sides run as a host without AVX-512 (or without AVX) runs
                 them: the kernels built with that host's flags (its CPU flags as the engine
                 reads them) and torch held to its instruction set (ATEN_CPU_CAPABILITY,
                 ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS); pass --dtype float32, its default

    python bench/engine_paired.py bf16-prepack [--pairs 6] [--batch 1] [--gen 64] [--figure tok_s] [--json PATH]
    python bench/engine_paired.py commit --against 3dbb5da --batch 32 --dtype bfloat16
    python bench/engine_paired.py commit --against 2e84a42 --as-host avx2 --dtype float32
    python bench/engine_paired.py commit --against fc00587 --workload bench   # make bench's b32 phase
    python bench/engine_paired.py commit --against HEAD --pool scattered --batch 16 --prompt 1536
    python bench/engine_paired.py commit --against 952cfc4 --batch 32 --sampling top-p   # sampled requests
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_workload import BATCH, load_engine, make_workload  # noqa: E402
from bench.engine_vs_llamacpp import engine_commit, ours_batched  # noqa: E402
from bench.harness import cpu_name, make_parser, write_json  # noqa: E402
from bench.paired_commits import worktree  # noqa: E402
from services.engine.config import load_model_config  # noqa: E402
from services.engine.default_model import default_model_dir  # noqa: E402
from services.engine.device import set_cpu_threads  # noqa: E402
from services.engine.engine import Engine, EngineConfig  # noqa: E402

# Two-sided 95% Student t quantiles by degrees of freedom (pairs - 1).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
       10: 2.228, 11: 2.201, 12: 2.179, 14: 2.145, 19: 2.093, 29: 2.045}


def t95(df: int) -> float:
    return T95[max(k for k in T95 if k <= df)]


def mean_interval(ratios: list[float]) -> tuple[float, float, float]:
    mean = statistics.fmean(ratios)
    half = t95(len(ratios) - 1) * statistics.stdev(ratios) / math.sqrt(len(ratios))
    return mean, mean - half, mean + half


def this_against_other(this: Callable[[], float], other: Callable[[], float], rounds: int) -> dict:
    """Two timed calls (each returns its seconds), alternating which runs first over `rounds`
    rounds after two untimed ones (the libraries, the OpenMP pool): each side's median ms and the
    mean of the rounds' ratios other / this (above 1: this faster) with its 95% t interval."""
    sides = {"this": this, "other": other}
    seconds = {"this": [], "other": []}
    for _ in range(2):
        for run in sides.values():
            run()
    for round_index in range(rounds):
        for name in (("this", "other") if round_index % 2 == 0 else ("other", "this")):
            seconds[name].append(sides[name]())
    mean, low, high = mean_interval([o / t for t, o in zip(seconds["this"], seconds["other"])])
    return {"this_ms": statistics.median(seconds["this"]) * 1e3, "other_ms": statistics.median(seconds["other"]) * 1e3,
            "ratio": mean, "interval": [low, high], "rounds": rounds}


def with_config(engine: Engine, **changes) -> Engine:
    """An engine like `engine` with some EngineConfig fields changed."""
    fields = {name: getattr(engine.config, name) for name in EngineConfig.__dataclass_fields__}
    return Engine(EngineConfig(**(fields | changes)))


def bf16_prepack(base: Engine) -> tuple[Engine, Engine]:
    return base, with_config(base, prepack_linear=False)


def linear_kernel(base: Engine) -> tuple[Engine, Engine]:
    with mock.patch("services.engine.linear.load_linear_kernel", lambda: None):
        return base, with_config(base)


def bf16_kernel(base: Engine) -> tuple[Engine, Engine]:
    return base, with_config(base, decode_attention="torch")


def pack_separately(layers: list) -> int:
    """The "off" side of huge-pages: each layer packed into an allocation of its own."""
    for layer in layers:
        if layer.kernel is not None:
            layer.pack_into(None)
    return 0


def huge_pages(base: Engine) -> tuple[Engine, Engine]:
    with mock.patch("services.engine.model.place_on_huge_pages", pack_separately):
        return base, with_config(base)


def fused_layer(base: Engine) -> tuple[Engine, Engine]:
    with mock.patch("services.engine.model.fused_decode_layers", lambda decoder: None):
        return base, with_config(base)


def fused_prompts(base: Engine) -> tuple[Engine, Engine]:
    off = with_config(base)
    applies = off.model.fused_layers.applies
    off.model.fused_layers.applies = lambda layout, *rest: layout.prompts is None and applies(layout, *rest)
    return base, off


def prompt_kernel(base: Engine) -> tuple[Engine, Engine]:
    return base, with_config(base, prompt_attention="torch")


BENCH_REQUESTS = 64     # --workload bench: make bench's batch-32 phase (engine_throughput.py --requests-b32)

# Run inside a checkout (its own bench/ and services/): one engine, then one run of the workload per
# line read, its figures printed as a JSON line (ours_batched, or the bench phase's tok/s). Both
# commits must have these modules.
SIDE = """
import json, sys
sys.path.insert(0, ".")
from bench.engine_throughput import load_engine, make_workload
from bench.engine_vs_llamacpp import ours_batched
from services.engine.config import load_model_config
from services.engine.default_model import default_model_dir
from services.engine.device import set_cpu_threads
a = json.loads(sys.argv[1])
if a.get("cpu_flags") is not None:        # --as-host: the engine reads these flags, not the CPU's
    import services.engine.device as device, services.engine.kernel_build as kernel_build
    device.cpu_flags = kernel_build.cpu_flags = lambda: frozenset(a["cpu_flags"])
if a.get("sampling"):                     # ours_batched's greedy requests sampled instead
    import bench.engine_vs_llamacpp as batched
    from services.common.step import SamplingParams
    batched.SamplingParams = lambda temperature, **rest: SamplingParams(**a["sampling"], **rest)
if a.get("pool") == "scattered":          # the free list shuffled, as a pool that has served a while
    import random
    from services.common import kv_blocks
    fresh = kv_blocks.KVBlockPool.__init__
    def shuffled(self, *args, **kwargs):
        fresh(self, *args, **kwargs)
        random.Random(a["seed"]).shuffle(self._free)
    kv_blocks.KVBlockPool.__init__ = shuffled
threads = set_cpu_threads(a["threads"])
model_dir = str(default_model_dir())
vocab = load_model_config(model_dir).vocab_size
if a.get("workload") == "bench":          # make bench's batch-32 phase: its requests, its BatchRunner
    from bench.engine_workload import (BATCH, OUTPUT_RANGE, PROMPT_RANGE, run_engine, useful_tokens,
                                       warmup_workload)
    engine = load_engine(model_dir, threads, PROMPT_RANGE[1], OUTPUT_RANGE[1], "cpu", a["dtype"])
    workload = make_workload(a["requests"], a["seed"], vocab, PROMPT_RANGE, OUTPUT_RANGE)
    def once():
        seconds, _ = run_engine(engine, workload, BATCH)
        return {"tok_s": useful_tokens(workload) / seconds, "seconds": seconds}
    run_engine(engine, warmup_workload(a["seed"], vocab), 2)
else:
    engine = load_engine(model_dir, threads, a["prompt"], a["gen"], "cpu", a["dtype"])
    workload = make_workload(a["batch"], a["seed"], vocab, (a["prompt"],) * 2, (a["gen"],) * 2)
    once = lambda: ours_batched(engine, workload, a["batch"])
once()
print(json.dumps({"ready": True}), flush=True)
for _ in sys.stdin:
    print(json.dumps(once()), flush=True)
"""


class CheckoutSide:
    """An engine of one checkout in a process of its own, run on request (CheckoutSide.run)."""

    def __init__(self, tree: Path, settings: dict, env: dict | None = None):
        self.tree = tree
        self.process = subprocess.Popen([sys.executable, "-c", SIDE, json.dumps(settings)], cwd=tree,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, **(env or {})})
        self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            sys.exit(f"the engine of {self.tree} ended (exit {self.process.wait()})")
        return json.loads(line)

    def run(self) -> dict:
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


SAMPLING = {"greedy": None, "top-p": {"temperature": 0.7, "top_p": 0.95}, "temperature": {"temperature": 1.0}}
CHANGES = {"fused-layer": ("bfloat16", fused_layer), "fused-prompts": ("bfloat16", fused_prompts),
           "huge-pages": ("bfloat16", huge_pages), "bf16-prepack": ("bfloat16", bf16_prepack),
           "linear-kernel": ("bfloat16", linear_kernel), "bf16-kernel": ("bfloat16", bf16_kernel),
           "prompt-kernel": ("bfloat16", prompt_kernel), "commit": ("bfloat16", None)}
PROMPT_CHANGES = {"prompt-kernel", "fused-prompts"}      # measured on prompt tokens/s; the rest on decode tokens/s
# --as-host: the CPU flags the engine then reads, and torch's own limits to the same instruction set
HOSTS = {
    "avx2": ({"sse2", "sse4_2", "avx", "avx2", "fma", "f16c"},
             {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
    "none": (set(), {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                     "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}),
}


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("change", choices=sorted(CHANGES))
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", help="the engines' dtype (default: the change's)")
    parser.add_argument("--figure", choices=["tok_s", "prefill_tok_s"],
                        help="the ratio of decode (tok_s) or prompt tok/s (default: the change's)")
    parser.add_argument("--against", help="commit: the other commit (the off side)")
    parser.add_argument("--workload", choices=["batched", "bench"], default="batched",
                        help="commit: `batch` requests of --prompt + --gen tokens (batched), or make "
                             "bench's batch-32 phase (bench: 64 requests of 16-256 + 16-128 tokens; "
                             "tok_s is then its generated tokens over its seconds, prompts included)")
    parser.add_argument("--pool", choices=["fresh", "scattered"], default="fresh",
                        help="commit: the KV pool's free list as a fresh pool orders it (each sequence's "
                             "blocks side by side) or shuffled, as a pool that has served for a while "
                             "(each sequence's blocks scattered)")
    parser.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                        help="commit, batched workload: how the requests sample (greedy, or as API "
                             "traffic does: temperature 0.7 with top-p 0.95, or temperature 1.0)")
    parser.add_argument("--as-host", choices=sorted(HOSTS),
                        help="commit: both sides as a host without AVX-512 (avx2) or without AVX (none)")
    args = parser.parse_args()
    if args.pairs < 2:
        parser.error("need at least 2 pairs for an interval")
    if (args.change == "commit") != bool(args.against):
        parser.error("--against goes with the change commit, and only with it")
    if (args.as_host or args.workload != "batched" or args.pool != "fresh") and args.change != "commit":
        parser.error("--as-host, --workload and --pool go with the change commit")
    if args.workload == "bench" and args.figure == "prefill_tok_s":
        parser.error("the bench workload's figure is its tok_s")
    if args.workload == "bench":
        args.batch = BATCH                    # the phase's concurrency, whatever --batch said
    dtype, build = CHANGES[args.change]
    dtype = args.dtype or dtype
    threads = set_cpu_threads(args.threads)
    figure = args.figure or ("prefill_tok_s" if args.change in PROMPT_CHANGES else "tok_s")
    if args.change == "commit":
        settings = {"threads": threads, "prompt": args.prompt, "gen": args.gen, "dtype": dtype,
                    "batch": args.batch, "seed": args.seed, "workload": args.workload, "requests": BENCH_REQUESTS,
                    "pool": args.pool, "sampling": SAMPLING[args.sampling]}
        flags, env = HOSTS[args.as_host] if args.as_host else (None, None)
        if flags is not None:
            settings["cpu_flags"] = sorted(flags)
        off_tree, off_sha = worktree(args.against, Path("/tmp/qos-paired"))
        sides = {"on": CheckoutSide(Path(__file__).resolve().parent.parent, settings, env),
                 "off": CheckoutSide(off_tree, settings, env)}
        run = {name: side.run for name, side in sides.items()}
        backends = None                          # each checkout picks its own
    else:
        model_dir = str(default_model_dir())
        config = load_model_config(model_dir)
        on, off = build(load_engine(model_dir, threads, args.prompt, args.gen, "cpu", dtype))
        backends = {"on": on.model.layers[0].qkv.backend, "off": off.model.layers[0].qkv.backend}
        print(f"linear layers: on {backends['on']}, off {backends['off']}", file=sys.stderr)
        workload = make_workload(args.batch, args.seed, config.vocab_size, (args.prompt,) * 2, (args.gen,) * 2)
        run = {"on": lambda: ours_batched(on, workload, args.batch), "off": lambda: ours_batched(off, workload, args.batch)}
        for side in run.values():      # warm-up: kernel selection, first-touch memory
            side()
    pairs = []
    for pair in range(args.pairs):
        order = ("on", "off") if pair % 2 == 0 else ("off", "on")
        runs = {}
        for side in order:
            load = os.getloadavg()[0]
            runs[side] = run[side]()
            runs[side]["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]
        runs["ratio"] = runs["on"][figure] / runs["off"][figure]
        pairs.append(runs)
        print(f"pair {pair + 1}/{args.pairs} ({order[0]} first): on {runs['on'][figure]:.1f}, "
              f"off {runs['off'][figure]:.1f} tok/s, ratio {runs['ratio']:.3f}", file=sys.stderr)
    if args.change == "commit":
        for side in sides.values():
            side.close()
    mean, low, high = mean_interval([p["ratio"] for p in pairs])
    verdict = "keep" if low > 1 else "drop"
    print(f"{args.change} ({dtype}, batch {args.batch}, {threads} threads): on / off {figure} "
          f"{mean:.3f}, 95% interval [{low:.3f}, {high:.3f}] over {args.pairs} pairs: {verdict}")
    write_json(args.json, {"change": args.change, "dtype": dtype, "batch": args.batch, "threads": threads,
                           "prompt_tokens": args.prompt, "generated_tokens": args.gen, "cpu": cpu_name(),
                           "linear_backends": backends, "engine_commit": engine_commit(),
                           "against": off_sha if args.change == "commit" else None, "as_host": args.as_host,
                           "workload": args.workload, "pool": args.pool, "sampling": args.sampling,
                           "figure": figure, "mean_ratio": mean, "ci95": [low, high], "verdict": verdict, "pairs": pairs})


if __name__ == "__main__":
    main()
