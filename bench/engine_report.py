"""bench/engine_throughput.py's checks and report: greedy outputs compared (engine against
transformers, one dtype against another), the tables (engine against transformers, the
roofline) and the targets judged."""
from __future__ import annotations

BF16_SPEEDUP_TARGET = 1.6     # bf16 b32 tok/s over fp32's,
PEAK_SHARE_TARGET = 0.5       # and b32 achieved GFLOPS over the dtype's matmul peak: met since bf16 came
# The hardware's limit, where llama.cpp is measured: batch 1 at this share of its (bandwidth) roof,
ROOF_SHARE_B1_LIMIT = 0.75
PEAK_SHARE_B32_LIMIT = 0.7    # batch 32 at this share of the matmul peak


def compare_greedy(engine_out: list[list[int]], hf_out: list[list[int]], eos_ids: set[int]) -> list[str]:
    """Mismatch descriptions (empty if the two sides agree).

    Compared up to the engine's first EOS only: with ignore_eos the engine may emit EOS as the
    argmax and go on, while HF's min_new_tokens masks EOS and takes the runner-up from there."""
    problems = []
    for i, (ours, theirs) in enumerate(zip(engine_out, hf_out)):
        end = next((pos for pos, token in enumerate(ours) if token in eos_ids), len(ours))
        diff = next((pos for pos in range(end) if ours[pos] != theirs[pos]), None)
        if diff is not None:
            problems.append(f"request {i}: first difference at output token {diff} of {end} compared "
                            f"(engine {ours[diff]}, HF {theirs[diff]})")
    return problems


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two dtypes' greedy outputs for the same requests agree: the tokens before each
    request's first difference (after one, the contexts differ and so may everything after), and
    the requests identical throughout."""
    same_prefix = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                      for x, y in zip(ours, theirs))
    return {"tokens_before_first_difference": same_prefix, "tokens": sum(len(x) for x in ours),
            "identical_requests": sum(x == y for x, y in zip(ours, theirs)), "requests": len(ours)}


def print_hf_table(report: dict, seconds: dict) -> None:
    w = report["workload"]
    print(f"\nengine against HF transformers ({report['hf_dtype']})")
    print(f"{'phase':<6}{'out tok':>9}{'engine s':>10}{'HF s':>9}{'engine tok/s':>14}{'HF tok/s':>10}"
          f"{'engine/HF':>11}")
    for phase in ("b1", "b32"):
        print(f"{phase:<6}{w[f'useful_tokens_{phase}']:>9}{seconds[f'engine_{phase}']:>10.1f}"
              f"{seconds[f'hf_{phase}']:>9.1f}{report[f'engine_tok_s_{phase}']:>14.1f}"
              f"{report[f'hf_tok_s_{phase}']:>10.1f}{report[f'ratio_{phase}']:>10.2f}x")


def print_roofline(report: dict, names: list[str]) -> None:
    print(f"\nroofline: memory bandwidth {report['bandwidth_gb_s']:.1f} GB/s (reading 512 MiB); matmul "
          f"peak per dtype on the model's shapes, FLOP-weighted over a step's linears")
    for name in names:
        by_rows = ", ".join(f"{rows} rows {g:.1f}" for rows, g in report[f"peak_gflops_by_rows_{name}"].items())
        ridge = report[f"peak_gflops_{name}"] / report["bandwidth_gb_s"]
        print(f"  {name}: peak {report[f'peak_gflops_{name}']:.1f} GFLOPS ({by_rows}); "
              f"ridge {ridge:.1f} FLOP/byte")
    print(f"{'dtype':<6}{'phase':<10}{'reqs':>5}{'steps':>6}{'tok/s':>8}{'GFLOPS':>8}{'of peak':>8}{'GB/s':>7}"
          f"{'FLOP/B':>8}  {'bound':<10}{'roof GFLOPS':>12}{'of roof':>8}")
    for name in names:
        for phase in ("b1", "b32", "b32_same"):
            key = f"{phase}_{name}"
            if f"tok_s_{key}" not in report:
                continue
            print(f"{name:<6}{phase:<10}{report[f'requests_{key}']:>5}{report[f'steps_{key}']:>6}"
                  f"{report[f'tok_s_{key}']:>8.1f}{report[f'achieved_gflops_{key}']:>8.1f}"
                  f"{report[f'of_peak_{key}']:>8.0%}{report[f'achieved_gb_s_{key}']:>7.1f}"
                  f"{report[f'flop_per_byte_{key}']:>8.1f}  {report[f'bound_{key}']:<10}"
                  f"{report[f'roof_gflops_{key}']:>12.1f}{report[f'of_roof_{key}']:>8.0%}")
            runs = report.get(f"runs_{key}", [])
            if len(runs) > 1:
                print(" " * 16 + f"{len(runs)} runs, each after its own bandwidth probe: " + ", ".join(
                    f"{r['tok_s']:.1f} tok/s at {r['bandwidth_gb_s']:.1f} GB/s = {r['of_roof']:.0%}" for r in runs))
            if runs and "decode_of_roof" in runs[0]:
                print(" " * 16 + "decode-only steps: " + ", ".join(
                    f"{r['decode_tok_s']:.1f} tok/s = {r['decode_of_roof']:.0%} of their roof" for r in runs))
    print("(GFLOPS: useful FLOPs, bench/roofline.py; roof: each step at the slower of its FLOPs at the "
          "peak and its bytes at the bandwidth)")


def judge_targets(report: dict, names: list[str]) -> list[str]:
    """The issue's targets, each as a line with PASS or FAIL (and the same into `report`)."""
    lines = []
    if "tok_s_b32_bf16" in report and "tok_s_b32_fp32" in report:
        bf16, fp32 = (report.get(f"tok_s_b32_same_{n}", report[f"tok_s_b32_{n}"]) for n in ("bf16", "fp32"))
        speedup = bf16 / fp32
        report["bf16_speedup_b32"] = speedup
        report["target_bf16_speedup_pass"] = speedup >= BF16_SPEEDUP_TARGET
        lines.append(f"bf16 b32 tok/s / fp32's on the same requests: {speedup:.2f}x (target >= "
                     f"{BF16_SPEEDUP_TARGET}x): {'PASS' if speedup >= BF16_SPEEDUP_TARGET else 'FAIL'}")
    for name in names:
        share = report[f"of_peak_b32_{name}"]
        report[f"target_peak_share_{name}_pass"] = share >= PEAK_SHARE_TARGET
        lines.append(f"{name} b32 achieved / matmul peak: {share:.0%} (target >= {PEAK_SHARE_TARGET:.0%}): "
                     f"{'PASS' if share >= PEAK_SHARE_TARGET else 'FAIL'}")
    for name in names:
        roof, peak = report[f"decode_of_roof_b1_{name}"], report[f"of_peak_b32_{name}"]
        if not report[f"decode_tok_s_b1_{name}"]:
            lines.append(f"{name} at the hardware's limit: b1 ran no decode-only step (outputs of one token): n/a")
            continue
        report[f"target_limit_{name}_pass"] = roof >= ROOF_SHARE_B1_LIMIT and peak >= PEAK_SHARE_B32_LIMIT
        lines.append(f"{name} at the hardware's limit: b1 decode steps {roof:.0%} of the bandwidth roof "
                     f"(>= {ROOF_SHARE_B1_LIMIT:.0%}; the phase with its prefills {report[f'of_roof_b1_{name}']:.0%}), "
                     f"b32 {peak:.0%} of the matmul peak (>= {PEAK_SHARE_B32_LIMIT:.0%}): "
                     f"{'PASS' if report[f'target_limit_{name}_pass'] else 'FAIL'}")
    return lines
