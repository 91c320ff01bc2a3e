#!/usr/bin/env python
"""The QoS burst in virtual time: scheduling quality that no host's noise can hide.

The design's burst (bench/qos_burst.py's workload, --scale multiplies the counts: 300 Low with the
longest prompts the context allows and 128 output tokens, 500 Medium of ~256 + 64 tokens, both at
uniform random times in the first --flood-seconds, and 200 High chat turns of 32 + 32 tokens as a
Poisson stream of --high-rate a second) through the real scheduler code (ContinuousBatcher:
planner, policy, KV caps, preemption, chunked prefill, High cut-ins) over a simulated worker
whose every step takes the time an accelerator profile gives for what it computes
(bench/sim/virtual_pool.py). FCFS and QoS get the same requests. Nothing depends on the host:
every run gives the same figures.

Profiles:
  local-cpu  this machine's engine (the bench model, 1 thread, the host's dtype, the burst's
             limits: 32 running, 128 tokens a step), fitted from its measured steps
             (bench/step_profile.py, read from --local-profile)
  h100, a100 datacenter GPUs, Llama-3-8B in bf16 (bench/sim/accelerators.py says where each
             figure comes from), 8,192-token context, 256 running, 2,048 tokens a step
  910b       a datacenter NPU (Ascend 910B), the same model, 128 running, 1,024 tokens a step

Per profile and policy: High's P99 time to first token (virtual ms, from arrival at the
scheduler) and in steps waited (steps begun after its arrival, before the one that gave its first
token), High's success rate, Low's tok/s (its output tokens over the time its last request ended)
and Low's KV peak (share of the blocks); beside them, QoS without High cut-ins (no target: the
wait for the scheduler's own steps). Targets, every profile: QoS High P99 <= 2 steps waited,
Low >= 0.85x FCFS, Low KV peak <= 30%; datacenter profiles: QoS High P99 TTFT < 200 ms.

--real PATH (a bench/qos_burst.py JSON with its --scale): the same burst at that scale on the
local-cpu profile next to the real run's figures (High P99 TTFT at the scheduler and at the
client, Low tok/s), with the difference.

    python bench/qos_virtual.py --json bench/results/qos_virtual.json [--profiles local-cpu,h100,a100,910b]
    python bench/qos_virtual.py --real bench/results/qos_burst.json
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import make_parser, progress, quantile, write_json  # noqa: E402
from bench.qos_workloads import burst_shapes  # noqa: E402
from bench.sim.accelerators import ACCELERATORS, Accelerator, local_cpu  # noqa: E402
from bench.sim.virtual_pool import VirtualPool  # noqa: E402
from bench.sim.workload import SimRequest  # noqa: E402
from services.common.priority import HIGH, LOW, MEDIUM, priority_name  # noqa: E402
from services.scheduler.policy import QoSSettings  # noqa: E402

LOCAL_PROFILE = Path(__file__).resolve().parent / "results" / "step_profile_local_cpu.json"
DATACENTER = ("h100", "a100", "910b")
DATACENTER_CONTEXT = 8192           # Llama-3-8B, the model the datacenter profiles describe
COUNTS = {LOW: 300, MEDIUM: 500, HIGH: 200}
TARGETS = {"high_p99_steps_waited": 2, "low_tok_s_ratio": 0.85, "low_kv_peak": 0.30, "datacenter_high_p99_ms": 200}


def load_profile(name: str, local_path: Path) -> tuple[Accelerator, int]:
    """The accelerator and its model's context length."""
    if name == "local-cpu":
        fit = json.loads(local_path.read_text())
        return local_cpu(fit["fixed_ms"], fit["ms_per_token"], fit["ms_per_kv_token"], fit["kv_tokens"],
                         fit["max_running"], fit["max_step_tokens"]), fit["max_context"]
    if name not in ACCELERATORS:
        raise SystemExit(f"unknown profile {name!r}: local-cpu or one of {', '.join(ACCELERATORS)}")
    return ACCELERATORS[name], DATACENTER_CONTEXT


def burst(max_context: int, scale: float, high_rate: float, flood_s: float, seed: int) -> list[SimRequest]:
    """The burst's requests, by arrival; ids in arrival order."""
    rng = random.Random(seed)
    shapes = burst_shapes(max_context)
    timed = []
    for priority in (LOW, MEDIUM):
        prompt, output = shapes[priority_name(priority)]
        timed += [(rng.uniform(0.0, flood_s), priority, prompt, output)
                  for _ in range(max(1, round(COUNTS[priority] * scale)))]
    t = 0.0
    prompt, output = shapes["high"]
    for _ in range(max(1, round(COUNTS[HIGH] * scale))):
        t += rng.expovariate(high_rate)
        timed.append((t, HIGH, prompt, output))
    timed.sort()
    return [SimRequest(i, at, p, prompt, output) for i, (at, p, prompt, output) in enumerate(timed)]


def idle_high_ttft_ms(accelerator: Accelerator, max_context: int) -> float:
    """One High request on an idle pool."""
    pool = VirtualPool(accelerator, "qos")
    prompt, output = burst_shapes(max_context)["high"]
    request = SimRequest(0, 0.0, HIGH, prompt, output)
    pool.run([request])
    return request.pool_ttft_ms


def run_policy(accelerator: Accelerator, policy: str, requests: list[SimRequest], label: str,
               settings: QoSSettings | None = None) -> dict:
    requests = [SimRequest(r.request_id, r.arrival, r.priority, r.prompt_tokens, r.output_tokens) for r in requests]
    pool = VirtualPool(accelerator, policy, settings)
    with progress(len(requests), label) as bar:
        pool.finish = _counting(pool.finish, bar)
        pool.run(requests)

    def of(p):
        return [r for r in requests if r.priority == p]

    high, low = of(HIGH), of(LOW)
    served_high = [r for r in high if r.first_token_at is not None]
    low_done = max((r.finished_at for r in low if r.finished_at is not None), default=0.0)
    waited = [pool.steps_waited[r.request_id + 1] for r in served_high]
    return {
        "high_p99_ttft_ms": quantile([r.pool_ttft_ms for r in served_high], 0.99),
        "high_p50_ttft_ms": quantile([r.pool_ttft_ms for r in served_high], 0.5),
        "high_p99_steps_waited": quantile(waited, 0.99),
        "high_max_steps_waited": max(waited, default=0),
        "high_success": len([r for r in high if r.finished_at is not None]) / len(high),
        "medium_p99_ttft_ms": quantile([r.pool_ttft_ms for r in of(MEDIUM) if r.first_token_at is not None], 0.99),
        "low_tok_s": sum(r.output_tokens for r in low if r.finished_at is not None) / low_done if low_done else 0.0,
        "low_kv_peak": pool.kv_peak_blocks[LOW] / pool.worker.pool.num_blocks,
        "preemptions": pool.batcher.preemptions, "cut_in_steps": pool.cut_in_steps, "steps": pool.steps,
        "mean_step_ms": pool.step_seconds / max(pool.steps, 1) * 1000,
        "virtual_s": max((r.finished_at or 0.0) for r in requests),
    }


def _counting(finish, bar):
    def counted(request, now):
        finish(request, now)
        bar.update()
    return counted


def run_profile(name: str, args) -> dict:
    accelerator, context = load_profile(name, args.local_profile)
    requests = burst(context, args.scale, args.high_rate, args.flood_seconds, args.seed)
    out = {"accelerator": {"fixed_ms": accelerator.fixed_ms, "ms_per_token": accelerator.ms_per_token,
                           "ms_per_kv_token": accelerator.ms_per_kv_token, "kv_tokens": accelerator.kv_tokens,
                           "max_running": accelerator.max_running, "max_step_tokens": accelerator.max_step_tokens,
                           "max_context": context},
           "high_idle_ttft_ms": idle_high_ttft_ms(accelerator, context)}
    for policy in ("fcfs", "qos"):
        out[policy] = run_policy(accelerator, policy, requests, f"{name} {policy}")
    # Beside it, no target: QoS without High cut-ins, how long High waits for the scheduler's own steps.
    out["qos_no_cut_ins"] = run_policy(accelerator, "qos", requests, f"{name} qos, no cut-ins",
                                       QoSSettings(high_cut_in=False))
    out["low_tok_s_ratio"] = out["qos"]["low_tok_s"] / out["fcfs"]["low_tok_s"]
    qos = out["qos"]
    checks = {"high_p99_steps_waited": qos["high_p99_steps_waited"] <= TARGETS["high_p99_steps_waited"],
              "low_tok_s_ratio": out["low_tok_s_ratio"] >= TARGETS["low_tok_s_ratio"],
              "low_kv_peak": qos["low_kv_peak"] <= TARGETS["low_kv_peak"]}
    if name in DATACENTER:
        checks["high_p99_ttft_ms"] = qos["high_p99_ttft_ms"] < TARGETS["datacenter_high_p99_ms"]
    out["targets_met"] = checks
    return out


def compare_real(path: Path, args) -> dict:
    """The local-cpu profile on the real run's burst (its scale), beside the real figures."""
    real = json.loads(path.read_text())
    # Runs recorded before qos_burst.py wrote its scale: from their High count ("30 high, ...").
    scale = real.get("scale") or float(real["requests"].split()[0]) / COUNTS[HIGH]
    accelerator, context = load_profile("local-cpu", args.local_profile)
    requests = burst(context, scale, args.high_rate, args.flood_seconds, args.seed)
    out = {"source": str(path), "scale": scale}
    for policy in ("fcfs", "qos"):
        sim = run_policy(accelerator, policy, requests, f"local-cpu {policy} x{scale:g}")
        measured = real[policy]
        rows = {"high_p99_ttft_ms (scheduler)": (measured["high_p99_server_ttft_ms"], sim["high_p99_ttft_ms"]),
                "high_p99_ttft_ms (client)": (measured["high_p99_ttft_ms"], sim["high_p99_ttft_ms"]),
                "high_p50_ttft_ms": (measured["high_p50_ttft_ms"], sim["high_p50_ttft_ms"]),
                "low_tok_s": (measured["low_tok_s"], sim["low_tok_s"]),
                "low_kv_peak": (measured["low_kv_peak_frac"], sim["low_kv_peak"])}
        out[policy] = {k: {"real": a, "simulated": b, "difference": b / a - 1 if a else None} for k, (a, b) in rows.items()}
        out[policy]["simulated"] = sim
    return out


def print_profiles(report: dict) -> None:
    rows = [("High P99 TTFT (virtual ms)", "high_p99_ttft_ms", "{:,.0f}"),
            ("High P50 TTFT (virtual ms)", "high_p50_ttft_ms", "{:,.0f}"),
            ("High P99 steps waited", "high_p99_steps_waited", "{:.0f}"),
            ("High success", "high_success", "{:.0%}"), ("Medium P99 TTFT (ms)", "medium_p99_ttft_ms", "{:,.0f}"),
            ("Low tok/s", "low_tok_s", "{:,.0f}"), ("Low KV peak", "low_kv_peak", "{:.1%}"),
            ("preemptions", "preemptions", "{}"), ("cut-in steps", "cut_in_steps", "{}"),
            ("steps", "steps", "{:,}"), ("mean step (ms)", "mean_step_ms", "{:.1f}")]
    for name, result in report["profiles"].items():
        a = result["accelerator"]
        print(f"\n{name}: step = {a['fixed_ms']:.2f} ms + {a['ms_per_token']:.4f} ms/token + "
              f"{a['ms_per_kv_token'] * 1000:.3f} us/KV token; {a['kv_tokens']:,} KV tokens, {a['max_running']} running, "
              f"{a['max_step_tokens']} tokens a step; High alone {result['high_idle_ttft_ms']:.1f} ms")
        print(f"{'':<28}{'FCFS':>12}{'QoS':>12}{'no cut-ins':>12}")
        for label, key, fmt in rows:
            print(f"{label:<28}" + "".join(f"{fmt.format(result[side][key]):>12}"
                                           for side in ("fcfs", "qos", "qos_no_cut_ins")))
        print(f"{'Low tok/s QoS / FCFS':<28}{'':>12}{result['low_tok_s_ratio']:>12.2f}")
        print("targets: " + ", ".join(f"{k} {'met' if ok else 'NOT met'}" for k, ok in result["targets_met"].items()))


def print_real(comparison: dict) -> None:
    print(f"\nsimulated (local-cpu) vs the real run in {comparison['source']} (scale {comparison['scale']:g})")
    for policy in ("fcfs", "qos"):
        for key, row in comparison[policy].items():
            if key == "simulated":
                continue
            diff = f"{row['difference']:+.0%}" if row["difference"] is not None else ""
            print(f"{policy:<6}{key:<32}{row['real']:>12,.1f}{row['simulated']:>12,.1f}{diff:>8}")


def main() -> None:
    parser = make_parser(__doc__, seed=True)
    parser.add_argument("--profiles", default="local-cpu,h100,a100,910b")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every request count")
    parser.add_argument("--high-rate", type=float, default=10.0, help="High arrivals per second")
    parser.add_argument("--flood-seconds", type=float, default=1.0)
    parser.add_argument("--local-profile", type=Path, default=LOCAL_PROFILE,
                        help="the local-cpu step fit (bench/step_profile.py --json)")
    parser.add_argument("--real", type=Path, help="a bench/qos_burst.py JSON to compare local-cpu with")
    args = parser.parse_args()
    report: dict = {"scale": args.scale, "seed": args.seed, "high_rate": args.high_rate,
                    "flood_seconds": args.flood_seconds, "targets": TARGETS, "profiles": {}}
    if args.real is None or args.profiles:
        for name in args.profiles.split(","):
            report["profiles"][name] = run_profile(name, args)
        print_profiles(report)
    if args.real is not None:
        report["real_comparison"] = compare_real(args.real, args)
        print_real(report["real_comparison"])
    write_json(args.json, report)


if __name__ == "__main__":
    main()
