#!/usr/bin/env python
"""Our engine and llama.cpp side by side: the same weights, threads, prompt and output lengths.

llama.cpp is the one vendored by llama-cpp-python's source distribution on PyPI, built here
(Release, -march=native) by `make llamacpp` (scripts/build_llamacpp.sh), which also converts the
default model's folder to GGUF in f32 and bf16 with the vendored convert_hf_to_gguf.py. Per
dtype, per repeat (the two sides alternate which goes first):

  llama.cpp   llama-batched-bench -npp P -ntg G -npl 1,8,32 -t T -tb T (prompts not shared:
              each sequence prefills its own P tokens, then G decode steps over all of them);
              once per dtype also llama-bench -p P -n G (its tg is batch-1 decode from an empty
              context, the figure llama.cpp users quote).
  ours        BatchRunner on the Engine (the benchmark's settings, bench/engine_throughput.py:
              paged C attention kernel, 512-token step budget as llama.cpp's -ub 512), B requests of
              P random tokens, G tokens forced (EOS ignored), all arriving at once.

Two figures per side and batch, best of the repeats (the least disturbed run on a shared host):
  tok_s   decode: tokens sampled by decode-only steps over those steps' seconds (llama.cpp's
          S_TG = B x G / T_TG). Ours mixes a few decodes into prefill steps; those are left out.
  e2e     B x G generated tokens over the whole run, prefill included (llama.cpp: B x G / T).
Roofline (bench/roofline.py, same threads): each side's decode phase against the roof of the
same work (B sequences at positions P .. P+G-1): max(FLOPs / matmul peak, bytes / bandwidth).

    python bench/engine_vs_llamacpp.py [--json PATH] [--threads 2] [--batches 1,8,32] [--repeats 2]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.engine_workload import Request, load_engine, make_workload  # noqa: E402
from bench.harness import cpu_name, make_parser, write_json  # noqa: E402
from bench.roofline import matmul_peak, memory_bandwidth, step_work  # noqa: E402
from services.common.step import SamplingParams  # noqa: E402
from services.engine.batch_runner import BatchRunner, GenerationRequest  # noqa: E402
from services.engine.config import ModelConfig, load_model_config  # noqa: E402
from services.engine.default_model import default_model_dir  # noqa: E402
from services.engine.device import DTYPES, set_cpu_threads  # noqa: E402

GGUF_TYPES = {"f32": "float32", "bf16": "bfloat16"}       # GGUF outtype -> our engine's dtype
HOST_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")
STEP_TOKENS = 512             # ours per step; llama.cpp's -ub (its -b is 2048)
MISSING = ("llama.cpp's binaries or GGUF weights are missing under {dir}: run `make llamacpp` "
           "(scripts/build_llamacpp.sh: downloads llama-cpp-python's sdist from PyPI, builds "
           "llama-bench and llama-batched-bench, converts the default model; ~10 minutes on 2 cores)")


def llamacpp_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qos-serve" / "llamacpp"
    return Path(os.environ.get("QOS_LLAMACPP_DIR", default))


def find_llamacpp(model_name: str, dtypes: list[str]) -> tuple[Path, dict[str, Path], Path]:
    """(bin folder, GGUF file per dtype, source folder), or exit saying how to get them."""
    root = llamacpp_dir()
    bins = sorted(root.glob("build-*/bin/llama-batched-bench"))
    ggufs = {d: root / "gguf" / f"{model_name}-{d}.gguf" for d in dtypes}
    if not bins or not (bins[-1].parent / "llama-bench").is_file() or not all(p.is_file() for p in ggufs.values()):
        sys.exit(MISSING.format(dir=root))
    version = bins[-1].parent.parent.name.removeprefix("build-")
    return bins[-1].parent, ggufs, root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def llamacpp_version(bin_dir: Path, src: Path) -> dict:
    out = subprocess.run([bin_dir / "llama-bench", "--version"], capture_output=True, text=True)
    commit = subprocess.run(["git", "-C", src, "log", "-1", "--format=%H %cs %s"], capture_output=True, text=True)
    return {"llama_cpp_python_sdist": src.parent.parent.name, "version_output": (out.stdout + out.stderr).strip(),
            "vendored_commit": commit.stdout.strip() or "unknown"}


def engine_commit() -> str:
    """This checkout's commit, "+changes" when services/engine differs from it: which code ran."""
    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "services/engine"],
                           capture_output=True, text=True)
    return (head.stdout.strip() or "unknown") + ("+changes" if dirty.stdout.strip() else "")


def host_flags() -> dict[str, bool]:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {f: f in flags for f in HOST_FLAGS}


def run_command(cmd: list[str], commands: list[str]) -> str:
    commands.append(" ".join(str(c) for c in cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{cmd[0]} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def llamacpp_batched(bin_dir: Path, gguf: Path, args, commands: list[str]) -> dict[int, dict]:
    context = max(args.batches) * (args.prompt + args.gen) + 64
    out = run_command([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(context),
                       "-b", "2048", "-ub", str(STEP_TOKENS), "-npp", str(args.prompt), "-ntg", str(args.gen),
                       "-npl", ",".join(map(str, args.batches)), "-t", str(args.threads),
                       "-tb", str(args.threads), "--output-format", "jsonl"], commands)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["pl"]: {"tok_s": r["speed_tg"], "e2e_tok_s": r["pl"] * r["tg"] / r["t"],
                      "prefill_tok_s": r["speed_pp"], "seconds": r["t"]} for r in rows}


def llamacpp_bench(bin_dir: Path, gguf: Path, args, commands: list[str]) -> dict:
    out = run_command([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", str(args.prompt),
                       "-n", str(args.gen), "-t", str(args.threads), "-r", str(args.bench_repeats), "-o", "json"],
                      commands)
    tests = json.loads(out)
    result = {"build_commit": tests[0].get("build_commit"), "build_number": tests[0].get("build_number")}
    for t in tests:
        kind = f"pp{t['n_prompt']}" if t["n_prompt"] else f"tg{t['n_gen']}"
        result[f"{kind}_tok_s"] = t["avg_ts"]
    return result


class TimedSteps:
    """The engine as BatchRunner uses it, timing each step and noting whether it only decoded."""

    def __init__(self, engine):
        self.engine = engine
        # (seconds, decode only, tokens sampled, tokens computed)
        self.steps: list[tuple[float, bool, int, int]] = []

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def step(self, batch):
        started = time.perf_counter()
        output = self.engine.step(batch)
        decode_only = all(s.num_generated > 0 for s in batch.sequences)
        self.steps.append((time.perf_counter() - started, decode_only, len(output.tokens),
                           sum(len(s.token_ids) for s in batch.sequences)))
        return output


def ours_batched(engine, requests: list[Request], batch: int) -> dict:
    timed = TimedSteps(engine)
    runner = BatchRunner(timed, max_running=batch, max_step_tokens=STEP_TOKENS)
    started = time.perf_counter()
    runner.run([GenerationRequest(r.prompt, SamplingParams(temperature=0.0, max_tokens=r.output_len,
                                                           ignore_eos=True)) for r in requests])
    seconds = time.perf_counter() - started
    decode = [(s, n) for s, only, n, _ in timed.steps if only]
    prompt = [(s, n) for s, only, _, n in timed.steps if not only]
    return {"tok_s": sum(n for _, n in decode) / sum(s for s, _ in decode),
            "prefill_tok_s": sum(n for _, n in prompt) / sum(s for s, _ in prompt),
            "e2e_tok_s": sum(r.output_len for r in requests) / seconds, "seconds": seconds,
            "decode_steps": len(decode), "steps": len(timed.steps)}


def decode_roof_tok_s(config: ModelConfig, batch: int, args, dtype: torch.dtype, peak_gflops: float,
                      gb_s: float) -> float:
    """Tokens/s of the decode phase if every step ran at its roof: B sequences at P .. P+G-1."""
    seconds = 0.0
    for position in range(args.prompt, args.prompt + args.gen):
        work = step_work(config, [(position, 1, True)] * batch, dtype)
        seconds += max(work.flops / (peak_gflops * 1e9), work.bytes / (gb_s * 1e9))
    return batch * args.gen / seconds


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--gen", type=int, default=128, help="generated tokens per sequence")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--dtypes", default="f32,bf16", help="GGUF types: f32, bf16")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, alternating; the best counts")
    parser.add_argument("--bench-repeats", type=int, default=3, help="llama-bench's -r")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    dtypes = args.dtypes.split(",")
    model_dir = str(default_model_dir())
    bin_dir, ggufs, src = find_llamacpp(Path(model_dir).name, dtypes)
    threads = set_cpu_threads(args.threads)
    config = load_model_config(model_dir)
    commands: list[str] = []
    report = {"model": Path(model_dir).name, "cpu": cpu_name(), "host_flags": host_flags(),
              "threads": threads, "torch": torch.__version__, "engine_commit": engine_commit(),
              "prompt_tokens": args.prompt,
              "generated_tokens": args.gen, "batches": args.batches, "repeats": args.repeats,
              "llamacpp": llamacpp_version(bin_dir, src), "gguf": {d: str(p) for d, p in ggufs.items()}}
    print("measuring memory bandwidth", file=sys.stderr)
    report["bandwidth_gb_s"] = gb_s = memory_bandwidth(torch.device("cpu"), lambda: None)
    workload = make_workload(max(args.batches), args.seed, config.vocab_size, (args.prompt,) * 2, (args.gen,) * 2)
    for d in dtypes:
        dtype = DTYPES[GGUF_TYPES[d]]
        engine = load_engine(model_dir, threads, args.prompt, args.gen, "cpu", GGUF_TYPES[d])
        report[f"decode_attention_{d}"] = "paged C kernel" if engine.decode_kernel is not None else "gather + SDPA"
        ours_batched(engine, make_workload(2, args.seed + 1, config.vocab_size, (8, 32), (4, 4)), 2)  # warm-up
        runs = {"llamacpp": [], "ours": []}
        for repeat in range(args.repeats):
            order = ["llamacpp", "ours"] if repeat % 2 == 0 else ["ours", "llamacpp"]
            for side in order:
                print(f"{d} repeat {repeat + 1}/{args.repeats}: {side}", file=sys.stderr)
                load = os.getloadavg()[0]
                run = (llamacpp_batched(bin_dir, ggufs[d], args, commands) if side == "llamacpp" else
                       {b: ours_batched(engine, workload[:b], b) for b in args.batches})
                for b in args.batches:      # the host's 1-minute load before and after: others' work
                    run[b]["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]
                runs[side].append(run)
        del engine
        report[f"llamacpp_bench_{d}"] = llamacpp_bench(bin_dir, ggufs[d], args, commands)
        print(f"measuring the {d} matmul peak", file=sys.stderr)
        peak = matmul_peak(config, dtype, torch.device("cpu"), lambda: None, rows=(max(args.batches),)).gflops
        report[f"peak_gflops_{d}"] = peak
        for b in args.batches:
            roof = decode_roof_tok_s(config, b, args, dtype, peak, gb_s)
            report[f"roof_tok_s_b{b}_{d}"] = roof
            for side, key in (("llamacpp", "llamacpp"), ("ours", "ours")):
                best = max(runs[side], key=lambda r: r[b]["tok_s"])[b]
                report[f"{key}_tok_s_b{b}_{d}"] = best["tok_s"]
                report[f"{key}_e2e_tok_s_b{b}_{d}"] = max(r[b]["e2e_tok_s"] for r in runs[side])
                report[f"{key}_of_roof_b{b}_{d}"] = best["tok_s"] / roof
                report[f"{key}_runs_b{b}_{d}"] = [r[b] for r in runs[side]]
            report[f"ratio_b{b}_{d}"] = report[f"ours_tok_s_b{b}_{d}"] / report[f"llamacpp_tok_s_b{b}_{d}"]
            report[f"ratio_e2e_b{b}_{d}"] = (report[f"ours_e2e_tok_s_b{b}_{d}"]
                                             / report[f"llamacpp_e2e_tok_s_b{b}_{d}"])
        report["dtypes_done"] = dtypes[:dtypes.index(d) + 1]
        report["commands"] = commands
        write_json(args.json, report)     # after each dtype: a long run on a busy host keeps what it measured
    print_table(report, dtypes, args.batches)


def print_table(report: dict, dtypes: list[str], batches: list[int]) -> None:
    print(f"\n{report['model']} | {report['cpu']} | {report['threads']} threads | prompt {report['prompt_tokens']}, "
          f"generated {report['generated_tokens']} | llama.cpp {report['llamacpp']['vendored_commit'][:12]}")
    print(f"{'dtype':<5} {'batch':>5} {'llama.cpp':>10} {'ours':>8} {'ratio':>6} {'roof':>8} "
          f"{'llama %roof':>11} {'ours %roof':>10} {'e2e ratio':>9}")
    for d in dtypes:
        for b in batches:
            k = f"b{b}_{d}"
            print(f"{d:<5} {b:>5} {report['llamacpp_tok_s_' + k]:>10.1f} {report['ours_tok_s_' + k]:>8.1f} "
                  f"{report['ratio_' + k]:>6.2f} {report['roof_tok_s_' + k]:>8.1f} "
                  f"{100 * report['llamacpp_of_roof_' + k]:>10.0f}% {100 * report['ours_of_roof_' + k]:>9.0f}% "
                  f"{report['ratio_e2e_' + k]:>9.2f}")


if __name__ == "__main__":
    main()
