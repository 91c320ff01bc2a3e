#!/usr/bin/env python
"""Output tokens/s of our engine against Hugging Face transformers generate(), and the engine's
roofline, per dtype, in one run.

Same model folder, same machine, same torch thread count, same device, identical prompts and
output lengths (EOS cannot end a request early on either side). For each of --dtypes (default
float32,bfloat16 on CPU; `--device cuda --dtypes bfloat16` on a GPU), two phases:

  b1   the first --requests-b1 requests one at a time (engine: BatchRunner with max_running=1;
       HF: generate() on a batch of one).
  b32  --requests-b32 requests with up to 32 at once (engine: continuous batching, max_running=32;
       HF: static batches of 32 consecutive requests, left-padded, every row generating the
       batch's longest requested output, since that is what static batching does).

HF runs in the first dtype only (ratio_b1, ratio_b32). Where bf16 is emulated (a CPU without
avx512_bf16 or amx_bf16: about 5x slower than fp32) its phases run fewer requests by default
(--bf16-requests-b1, --bf16-requests-b32), and the first dtype's engine also runs that smaller b32
workload, so that the bf16/fp32 speedup compares the same requests.

tokens/s = requested output tokens (the sum of each request's length; HF's extra tokens in a
static batch are not counted) / wall seconds of the whole phase, prefill included.

Roofline (bench/roofline.py, same process and threads): the matmul peak per dtype (F.linear or
the engine's prepacked oneDNN linear, whichever is faster, on the model's own shapes at 32 rows
and at a prefill step's rows, best of 5), the memory bandwidth (reading 512 MiB, best of 5), and
each engine phase's achieved GFLOPS and GB/s, its bound (compute or bandwidth) and its share of it.

Each engine phase runs --repeats times, each run right after a bandwidth probe of its own: the
host's bandwidth moves by up to 2x within minutes (other tenants share its memory), and a run set
against a probe taken minutes earlier measures the host as much as the engine. Each run is put on
the roofline with its own probe's bandwidth; the phase's figures are those of the run with the
median share of its roof, and the JSON keeps every run (`runs_<phase>_<dtype>`). Beside each
phase, its decode-only steps alone (each timed in engine.step): where the bandwidth roof applies.

    python bench/engine_throughput.py [--json PATH] [--model DIR] [--threads N] [--dtypes float32] ...
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# Run as a script: put the repo root on sys.path, for `services` and `bench.harness`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bench.engine_report import (compare_greedy, greedy_agreement, judge_targets, print_hf_table,  # noqa: E402
                                 print_roofline)
from bench.harness import cpu_name, make_parser, progress, write_json  # noqa: E402
from bench.hf_baseline import hf_generate, run_hf  # noqa: E402
from bench.roofline import matmul_peak, memory_bandwidth, phase_roofline, step_work  # noqa: E402
# The workload and the engine's runs, from here too: engine_paired.py runs older checkouts'
# `from bench.engine_throughput import load_engine, make_workload`.
from bench.engine_workload import (BATCH, ENGINE_MAX_STEP_TOKENS, OUTPUT_RANGE, PROMPT_RANGE,  # noqa: E402,F401
                                   Request, StepRecorder, load_engine, make_workload, run_engine,
                                   useful_tokens, warmup_workload)
from services.common.config import DECODE_ATTENTION  # noqa: E402
from services.engine.config import ModelConfig, load_model_config  # noqa: E402
from services.engine.default_model import default_model_dir  # noqa: E402
from services.engine.device import DTYPES, DeviceBackend, cpu_has_native_bf16, open_backend, set_cpu_threads  # noqa: E402
from services.engine.engine import Engine  # noqa: E402

EMULATED_BF16_REQUESTS = (1, 32)   # default b1 and b32 requests where bf16 is emulated (one full batch)
SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# --- one dtype -----------------------------------------------------------------------------------

@dataclass(slots=True)
class Phase:
    """One engine phase's run: its requests, wall seconds, engine steps and outputs."""
    requests: list[Request]
    seconds: float
    steps: list[list[tuple[int, int, bool]]]     # StepRecorder's
    step_seconds: list[float]                     # ... and their times
    outputs: list[list[int]]
    bandwidth_gb_s: float                         # the probe read just before this run

    @property
    def tok_s(self) -> float:
        return useful_tokens(self.requests) / self.seconds


def run_phase(engine: Engine, label: str, requests: list[Request], batch: int,
              repeats: int) -> list[Phase]:
    """`repeats` runs of the phase, each right after a bandwidth probe (the module docstring)."""
    runs = []
    for run in range(repeats):
        bandwidth = memory_bandwidth(engine.device, engine.backend.synchronize)
        recorder = StepRecorder(engine)
        with progress(useful_tokens(requests), f"{label} ({run + 1}/{repeats})", unit="tok") as bar:
            seconds, outputs = run_engine(recorder, requests, batch, bar)
        runs.append(Phase(requests, seconds, recorder.steps, recorder.seconds, outputs, bandwidth))
    if any(run.outputs != runs[0].outputs for run in runs):
        raise RuntimeError(f"{label}: the engine's greedy outputs differ between runs of the same requests")
    return runs


def same_workload(phases: dict[str, Phase]) -> Phase:
    """The b32 phase that every dtype ran on the same requests."""
    return phases.get("b32_same", phases["b32"])


def bf16_is_emulated(dtype: torch.dtype, backend: DeviceBackend) -> bool:
    return dtype == torch.bfloat16 and backend.kind == "cpu" and not cpu_has_native_bf16(backend.flags)


def roofline(config: ModelConfig, phases: dict[str, list[Phase]], dtype: torch.dtype, backend: DeviceBackend,
             report: dict) -> dict[str, Phase]:
    """Measure the dtype's matmul peak and put each run of each phase on the roofline (with its
    own probe's bandwidth), into `report`; returns each phase's run of median share of its roof."""
    name = SHORT_NAMES[dtype]
    peak = matmul_peak(config, dtype, backend.device, backend.synchronize,
                       rows=(BATCH, ENGINE_MAX_STEP_TOKENS))
    report[f"peak_gflops_{name}"] = peak.gflops
    report[f"peak_rows_{name}"] = peak.rows
    report[f"peak_gflops_by_rows_{name}"] = peak.by_rows
    report[f"matmul_gflops_by_shape_{name}"] = peak.by_shape
    chosen = {}
    for phase_name, runs in phases.items():
        points = [phase_roofline([step_work(config, entries, dtype) for entries in run.steps],
                                 run.seconds, peak.gflops, run.bandwidth_gb_s) for run in runs]
        decodes = [decode_roofline(config, run, dtype, peak.gflops) for run in runs]
        # The median run (the lower middle of an even count): its figures are one real run's.
        middle = sorted(range(len(runs)), key=lambda i: points[i].of_roof)[(len(runs) - 1) // 2]
        phase, point, key = runs[middle], points[middle], f"{phase_name}_{name}"
        chosen[phase_name] = phase
        report[f"tok_s_{key}"] = phase.tok_s
        report[f"requests_{key}"] = len(phase.requests)
        report[f"steps_{key}"] = len(phase.steps)
        report[f"seconds_{key}"] = phase.seconds
        report[f"bandwidth_gb_s_{key}"] = phase.bandwidth_gb_s
        report.update({f"{field}_{key}": value for field, value in asdict(point).items()})
        report[f"decode_of_roof_{key}"] = decodes[middle].of_roof if decodes[middle] else 0.0
        report[f"decode_tok_s_{key}"] = decode_tok_s(phase)
        report[f"runs_{key}"] = [{"tok_s": run.tok_s, "bandwidth_gb_s": run.bandwidth_gb_s, "of_roof": p.of_roof,
                                  "of_peak": p.of_peak, "decode_of_roof": d.of_roof if d else 0.0,
                                  "decode_tok_s": decode_tok_s(run)}
                                 for run, p, d in zip(runs, points, decodes)]
    return chosen


def decode_steps(run: Phase) -> list[tuple[list[tuple[int, int, bool]], float]]:
    """The run's decode-only steps (every sequence computes one token) and their times."""
    return [(entries, seconds) for entries, seconds in zip(run.steps, run.step_seconds)
            if all(n == 1 for _, n, _ in entries)]


def decode_roofline(config: ModelConfig, run: Phase, dtype: torch.dtype, peak_gflops: float):
    """The run's decode-only steps on the roofline, timed in engine.step: the part of a phase
    that reads the weights for a token or a few, where the bandwidth roof applies (a prefill step
    is set against the matmul peak of 512-row steps, which a short prompt does not reach)."""
    steps = decode_steps(run)
    if not steps:           # every request ended at its first token: no decode step to judge
        return None
    return phase_roofline([step_work(config, entries, dtype) for entries, _ in steps],
                          sum(seconds for _, seconds in steps), peak_gflops, run.bandwidth_gb_s)


def decode_tok_s(run: Phase) -> float:
    steps = decode_steps(run)
    return sum(len(entries) for entries, _ in steps) / sum(seconds for _, seconds in steps) if steps else 0.0


def parse_args() -> argparse.Namespace:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--model", help="Hugging Face model folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = all cores)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda[:N] or npu[:N] (both sides)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="engine dtypes, comma-separated; HF runs in the first only")
    parser.add_argument("--decode-attention", default="auto", choices=DECODE_ATTENTION,
                        help="the engine's decode attention: the paged C kernel (CPU) or gather + SDPA")
    parser.add_argument("--requests-b32", type=int, default=64)
    parser.add_argument("--requests-b1", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each engine phase, each after a bandwidth probe of its own")
    parser.add_argument("--bf16-requests-b32", type=int, help="bf16's b32 requests (default: as --requests-b32; "
                        f"where bf16 is emulated, {EMULATED_BF16_REQUESTS[1]})")
    parser.add_argument("--bf16-requests-b1", type=int, help="bf16's b1 requests (default: as --requests-b1; "
                        f"where bf16 is emulated, {EMULATED_BF16_REQUESTS[0]})")
    parser.add_argument("--min-prompt", type=int, default=PROMPT_RANGE[0])
    parser.add_argument("--max-prompt", type=int, default=PROMPT_RANGE[1])
    parser.add_argument("--min-output", type=int, default=OUTPUT_RANGE[0])
    parser.add_argument("--max-output", type=int, default=OUTPUT_RANGE[1])
    args = parser.parse_args()
    if not 1 <= args.min_prompt <= args.max_prompt or not 1 <= args.min_output <= args.max_output:
        parser.error("need 1 <= min <= max for both prompt and output lengths")
    counts = [args.requests_b1, args.requests_b32, args.bf16_requests_b1, args.bf16_requests_b32]
    if min(c for c in counts if c is not None) < 1 or args.threads < 0 or args.repeats < 1:
        parser.error("request counts and --repeats must be >= 1, --threads >= 0")
    args.dtypes = args.dtypes.split(",")
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown or len({DTYPES[d] for d in args.dtypes}) != len(args.dtypes):
        parser.error(f"--dtypes: distinct names among {', '.join(DTYPES)}")
    return args


def dtype_requests(args: argparse.Namespace, dtype: torch.dtype, backend: DeviceBackend) -> tuple[int, int]:
    """(b1, b32) request counts for one dtype."""
    b1, b32 = args.requests_b1, args.requests_b32
    if dtype != torch.bfloat16:
        return b1, b32
    if bf16_is_emulated(dtype, backend):
        b1, b32 = min(b1, EMULATED_BF16_REQUESTS[0]), min(b32, EMULATED_BF16_REQUESTS[1])
    return args.bf16_requests_b1 or b1, args.bf16_requests_b32 or b32


def run_hf_phases(model_dir: str, dtype: torch.dtype, backend: DeviceBackend, config: ModelConfig,
                  warmup: list[Request], phases: dict[str, list[Request]]) -> tuple[dict, dict]:
    """HF transformers' seconds and outputs per phase, in `dtype`."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(backend.device).eval()
    pad_id = hf.generation_config.pad_token_id
    if pad_id is None:
        pad_id = config.eos_token_ids[0]
    hf_generate(hf, warmup, pad_id)
    seconds, outputs = {}, {}
    for phase, requests in phases.items():
        with progress(useful_tokens(requests), f"{'HF ' + phase:<16}", unit="tok") as bar:
            seconds[phase], outputs[phase] = run_hf(hf, requests, 1 if phase == "b1" else BATCH, pad_id, bar)
    return seconds, outputs


@dataclass(slots=True)
class Setup:
    """What every dtype's run shares."""
    args: argparse.Namespace
    model_dir: str
    config: ModelConfig
    backend: DeviceBackend
    threads: int
    dtypes: list[torch.dtype]
    counts: dict[torch.dtype, tuple[int, int]]    # (b1, b32) requests per dtype
    workload: list[Request]                       # each phase runs its first requests
    warmup: list[Request]


def prepare(args: argparse.Namespace) -> Setup:
    # Before any model loads, so every side and every probe runs with the same intra-op threads.
    threads = set_cpu_threads(args.threads)
    model_dir = args.model or str(default_model_dir())
    config = load_model_config(model_dir)
    if args.max_prompt + args.max_output > config.max_context:
        sys.exit(f"prompt + output of up to {args.max_prompt + args.max_output} tokens exceed the "
                 f"model's {config.max_context}-token context")
    backend = open_backend(args.device)
    dtypes = [DTYPES[d] for d in args.dtypes]
    counts = {d: dtype_requests(args, d, backend) for d in dtypes}
    workload = make_workload(max(max(c) for c in counts.values()), args.seed, config.vocab_size,
                             (args.min_prompt, args.max_prompt), (args.min_output, args.max_output))
    return Setup(args, model_dir, config, backend, threads, dtypes, counts, workload,
                 warmup_workload(args.seed, config.vocab_size))


def base_report(setup: Setup) -> dict:
    args, backend, first = setup.args, setup.backend, setup.dtypes[0]
    b1, b32 = setup.counts[first]
    return {
        "model": Path(setup.model_dir).name,
        "machine": {"cpu": cpu_name(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "device": str(backend.device),
                    "device_name": backend.name},
        "threads": setup.threads, "dtypes": [SHORT_NAMES[d] for d in setup.dtypes], "hf_dtype": SHORT_NAMES[first],
        "cpu_native_bf16": backend.kind == "cpu" and cpu_has_native_bf16(backend.flags),
        "default_dtype": SHORT_NAMES[backend.preferred_dtype], "default_dtype_reason": backend.dtype_reason,
        "workload": {"seed": args.seed, "requests_b1": b1, "requests_b32": b32,
                     "requests": {SHORT_NAMES[d]: list(c) for d, c in setup.counts.items()},
                     "prompt_len": [args.min_prompt, args.max_prompt],
                     "output_len": [args.min_output, args.max_output],
                     "useful_tokens_b1": useful_tokens(setup.workload[:b1]),
                     "useful_tokens_b32": useful_tokens(setup.workload[:b32]),
                     "batch": BATCH, "engine_max_step_tokens": ENGINE_MAX_STEP_TOKENS,
                     "repeats": args.repeats},
    }


def run_dtype(setup: Setup, dtype: torch.dtype, report: dict) -> dict[str, Phase]:
    """The engine's phases in one dtype, then that dtype's matmul peak and roofline (into `report`)."""
    name, args = SHORT_NAMES[dtype], setup.args
    print(f"loading {setup.model_dir} on {setup.backend.device} ({setup.backend.name}, {name}, "
          f"{setup.threads} threads)", file=sys.stderr)
    engine = load_engine(setup.model_dir, setup.threads, args.max_prompt, args.max_output, args.device,
                         args.dtypes[setup.dtypes.index(dtype)], args.decode_attention)
    report[f"decode_attention_{name}"] = "paged C kernel" if engine.decode_kernel is not None else "gather + SDPA"
    run_engine(engine, setup.warmup, max_running=2)     # allocator, kernel selection, lazy imports
    b1, b32 = setup.counts[dtype]
    workload = setup.workload
    repeats = args.repeats
    phases = {"b1": run_phase(engine, f"engine {name} b1", workload[:b1], 1, repeats),
              "b32": run_phase(engine, f"engine {name} b32", workload[:b32], BATCH, repeats)}
    smallest = min(c[1] for c in setup.counts.values())
    if smallest < b32:
        # Another dtype's smaller b32 workload too, for a speedup over the same requests.
        phases["b32_same"] = run_phase(engine, f"engine {name} b32 x{smallest}", workload[:smallest], BATCH,
                                       repeats)
    del engine
    print(f"measuring the {name} matmul peak", file=sys.stderr)
    return roofline(setup.config, phases, dtype, setup.backend, report)


def compare_with_hf(setup: Setup, engine_phases: dict[str, Phase], report: dict) -> tuple[dict, list[str]]:
    """HF in the first dtype on the same phases: seconds of both sides, and the b1 greedy check's
    problems (the two sides did the same work only if their greedy tokens agree)."""
    hf_seconds, hf_outputs = run_hf_phases(setup.model_dir, setup.dtypes[0], setup.backend, setup.config,
                                           setup.warmup, {p: engine_phases[p].requests for p in ("b1", "b32")})
    seconds = {}
    for phase in ("b1", "b32"):
        seconds[f"engine_{phase}"], seconds[f"hf_{phase}"] = engine_phases[phase].seconds, hf_seconds[phase]
        report[f"engine_tok_s_{phase}"] = engine_phases[phase].tok_s
        report[f"hf_tok_s_{phase}"] = useful_tokens(engine_phases[phase].requests) / hf_seconds[phase]
        report[f"ratio_{phase}"] = report[f"engine_tok_s_{phase}"] / report[f"hf_tok_s_{phase}"]
    report.update({f"{k}_seconds": v for k, v in seconds.items()})
    problems = compare_greedy(engine_phases["b1"].outputs, hf_outputs["b1"], set(setup.config.eos_token_ids))
    report["b1_greedy_match"] = not problems
    return seconds, problems


def print_header(setup: Setup, report: dict, runs: dict[torch.dtype, dict[str, Phase]]) -> None:
    w, backend = report["workload"], setup.backend
    print(f"\nmodel {report['model']} | {backend.device} ({backend.name}) | CPU {cpu_name()} | "
          f"{setup.threads} threads | torch {torch.__version__}, transformers {transformers.__version__} | "
          "decode attention: " + ", ".join(f"{n} {report[f'decode_attention_{n}']}" for n in report["dtypes"]))
    print(f"workload: seed {w['seed']}; prompt {w['prompt_len'][0]}-{w['prompt_len'][1]} tokens, output "
          f"{w['output_len'][0]}-{w['output_len'][1]} tokens (forced); engine max_step_tokens "
          f"{ENGINE_MAX_STEP_TOKENS}; " + "; ".join(f"{n}: b1 {b1}, b32 {b32} requests"
                                                    for n, (b1, b32) in w["requests"].items()))
    print(f"this machine's default dtype: {report['default_dtype']} ({report['default_dtype_reason']})")
    if torch.bfloat16 in runs and bf16_is_emulated(torch.bfloat16, backend):
        b1, b32 = setup.counts[torch.bfloat16]
        print(f"bf16 is emulated on this CPU: its phases run at most {EMULATED_BF16_REQUESTS[0]} and "
              f"{EMULATED_BF16_REQUESTS[1]} requests unless told (--bf16-requests-b1/-b32), here {b1} and "
              f"{b32}; tokens/s is a rate, and the bf16/fp32 speedup compares the same "
              f"{len(same_workload(runs[torch.bfloat16]).requests)} b32 requests in both dtypes")


def main() -> None:
    setup = prepare(parse_args())
    report = base_report(setup)
    print(f"measuring memory bandwidth ({setup.threads} threads)", file=sys.stderr)
    report["bandwidth_gb_s"] = memory_bandwidth(setup.backend.device, setup.backend.synchronize)
    runs = {dtype: run_dtype(setup, dtype, report) for dtype in setup.dtypes}
    first = setup.dtypes[0]
    seconds, problems = compare_with_hf(setup, runs[first], report)
    for dtype in setup.dtypes[1:]:
        report[f"greedy_agreement_{SHORT_NAMES[dtype]}_vs_{SHORT_NAMES[first]}"] = greedy_agreement(
            same_workload(runs[dtype]).outputs, same_workload(runs[first]).outputs)

    print_header(setup, report, runs)
    print_hf_table(report, seconds)
    for problem in problems:
        print(f"WARNING: engine and HF greedy tokens differ on b1 {problem}")
    if not problems:
        print(f"check: engine greedy tokens equal HF's on all {len(runs[first]['b1'].requests)} b1 requests")
    for key, agreement in report.items():
        if key.startswith("greedy_agreement_"):
            print(f"{key.removeprefix('greedy_agreement_').replace('_', ' ')} greedy, b32: "
                  f"{agreement['tokens_before_first_difference']}/{agreement['tokens']} tokens before the "
                  f"first difference, {agreement['identical_requests']}/{agreement['requests']} requests identical")
    print_roofline(report, report["dtypes"])
    print()
    for line in judge_targets(report, report["dtypes"]):
        print(f"target: {line}")
    write_json(setup.args.json, report)


if __name__ == "__main__":
    main()
