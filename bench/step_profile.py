#!/usr/bin/env python
"""This machine's engine step time, measured and fitted: the `local-cpu` accelerator profile of
the virtual-time benchmarks (bench/qos_virtual.py, bench/tenant_service.py).

Runs the engine in this process (the benchmark model unless --model, CPU, --threads torch threads
and --dtype, by default the host's as the QoS burst's worker picks it) over a scaled copy of the
burst's request shapes with the burst's scheduler limits (up to --max-running sequences,
--max-step-tokens tokens a step: full prefill-chunk steps, decode-only steps of every batch size,
KV from empty to thousands of tokens), --repeats times, times every step (engine.step: forward and
sampling), and fits

    step_ms = fixed_ms + ms_per_token * tokens computed + ms_per_kv_token * KV tokens read

by least squares over the steps of all repeats (services/common/step_fit.py, unfaded): on a
shared host one run's fit moves by half its fixed term from one minute to the next, and the
pooled fit sits inside the runs' spread (each run's own fit is in the JSON). KV tokens read: the
context every sequence in the step attends (its position after the step), which is what the
scheduler's pools hold for their running sequences. Prints the fit, how well it explains the
steps (R^2, median and P90 relative error) and writes them, with the KV capacity the burst's
worker has (--kv-cache-mb) and the limits, as the profile JSON.

    python bench/step_profile.py --json bench/results/step_profile_local_cpu.json [--threads 1] [--repeats 3]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import machine, make_parser, model_or_bench, progress, quantile, write_json  # noqa: E402
from bench.qos_workloads import burst_shapes  # noqa: E402
from services.common.step import SamplingParams, StepBatch  # noqa: E402
from services.common.step_fit import StepFit  # noqa: E402
from services.engine.batch_runner import BatchRunner, GenerationRequest  # noqa: E402
from services.engine.device import set_cpu_threads  # noqa: E402
from services.engine.engine import Engine, EngineConfig  # noqa: E402

# Requests of each class in the measured run: a scaled burst (its three shapes, in the burst's
# proportions of work), long enough for a few hundred steps of every kind.
COUNTS = {"low": 12, "medium": 40, "high": 24}
FIRST_PLAIN_TOKEN_ID = 100


class TimedEngine:
    """The engine with every step timed: (tokens, KV tokens read, ms)."""

    def __init__(self, engine: Engine, bar):
        self.engine, self.bar = engine, bar
        self.steps: list[tuple[int, int, float]] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, batch: StepBatch):
        started = time.perf_counter()
        output = self.engine.step(batch)
        ms = (time.perf_counter() - started) * 1000
        self.steps.append((batch.num_tokens, sum(s.end for s in batch.sequences), ms))
        self.bar.update(batch.num_tokens)
        return output


def requests_of(max_context: int, vocab: int) -> list[GenerationRequest]:
    """The classes interleaved (Low's long prompts among Medium's and High's), fixed lengths."""
    shapes = burst_shapes(max_context)
    out, token = [], FIRST_PLAIN_TOKEN_ID
    order = [p for i in range(max(COUNTS.values())) for p in COUNTS if i < COUNTS[p]]
    for priority in order:
        prompt_len, output_len = shapes[priority]
        prompt = [(token + i) % (vocab - FIRST_PLAIN_TOKEN_ID) + FIRST_PLAIN_TOKEN_ID for i in range(prompt_len)]
        token += prompt_len
        out.append(GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)))
    return out


def fit_steps(steps: list[tuple[int, int, float]]) -> dict:
    fit = StepFit(fade=1.0)
    for tokens, kv, ms in steps:
        fit.add(tokens, kv, ms, 1.0)
    fit.solve()
    predicted = [fit.step_ms(t, kv) for t, kv, _ in steps]
    measured = [ms for _, _, ms in steps]
    mean = sum(measured) / len(measured)
    total = sum((m - mean) ** 2 for m in measured)
    residual = sum((m - p) ** 2 for m, p in zip(measured, predicted))
    errors = [abs(p / m - 1) for m, p in zip(measured, predicted) if m > 0]
    return {"fixed_ms": fit.fixed_ms, "ms_per_token": fit.ms_per_token, "ms_per_kv_token": fit.ms_per_kv_token,
            "r2": 1 - residual / total if total else 1.0, "median_rel_error": quantile(errors, 0.5),
            "p90_rel_error": quantile(errors, 0.9), "steps": len(steps),
            "mean_step_ms": mean, "total_measured_s": sum(measured) / 1000,
            "total_predicted_s": sum(predicted) / 1000}


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--model", help="model folder (default: the random-weight bench model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the burst's worker: 1)")
    parser.add_argument("--kv-cache-mb", type=int, default=1024, help="the burst's worker's KV budget")
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--max-step-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=("fp32", "bf16"),
                        help="the engine's dtype (default: the host's, as the burst's worker picks it)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the workload whose steps are fitted together")
    args = parser.parse_args()
    threads = set_cpu_threads(args.threads)
    model_dir = model_or_bench(args.model)
    engine = Engine(EngineConfig(model_dir=model_dir, device="cpu", dtype=args.dtype, num_threads=threads,
                                 kv_cache_bytes=args.kv_cache_mb * 2**20))
    dtype = str(engine.dtype).removeprefix("torch.")
    warmup = BatchRunner(engine, max_running=2, max_step_tokens=args.max_step_tokens)
    warmup.run(requests_of(engine.max_context, engine.model_config.vocab_size)[-2:])
    runs = []
    for run in range(args.repeats):
        requests = requests_of(engine.max_context, engine.model_config.vocab_size)
        total = sum(len(r.prompt_ids) + r.sampling.max_tokens for r in requests)
        with progress(total, f"engine steps, run {run + 1}/{args.repeats}", unit="tok") as bar:
            timed = TimedEngine(engine, bar)
            BatchRunner(timed, max_running=args.max_running, max_step_tokens=args.max_step_tokens).run(requests)
        runs.append(timed.steps)
    steps = [step for run in runs for step in run]
    fit = fit_steps(steps)
    run_fits = [fit_steps(run) for run in runs]
    for i, one in enumerate(run_fits):
        print(f"run {i + 1}: step_ms = {one['fixed_ms']:.3f} + {one['ms_per_token']:.4f} x tokens + "
              f"{one['ms_per_kv_token'] * 1000:.4f} us x KV tokens (R^2 {one['r2']:.3f})")
    print(f"\n{fit['steps']} steps of the bench model ({dtype}) on {machine()}, {threads} thread(s), "
          f"{len(runs)} runs: step_ms = {fit['fixed_ms']:.3f} + {fit['ms_per_token']:.4f} x tokens + "
          f"{fit['ms_per_kv_token'] * 1000:.4f} us x KV tokens; R^2 {fit['r2']:.3f}, relative error median "
          f"{fit['median_rel_error']:.1%}, P90 {fit['p90_rel_error']:.1%}")
    write_json(args.json, {
        "name": "local-cpu", "model": Path(model_dir).name, "machine": machine(), "threads": threads,
        "dtype": dtype, "max_context": engine.max_context,
        "kv_tokens": engine.kv_spec.num_blocks * engine.kv_spec.block_size,
        "max_running": args.max_running, "max_step_tokens": args.max_step_tokens, **fit,
        "runs": [{key: one[key] for key in ("fixed_ms", "ms_per_token", "ms_per_kv_token", "r2", "steps")}
                 for one in run_fits],
        "step_samples": [[t, kv, round(ms, 3)] for t, kv, ms in steps]})


if __name__ == "__main__":
    main()
