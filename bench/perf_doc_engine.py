"""The engine's tables in docs/performance.md: its roofline (bench/engine_throughput.py's JSON) and
the side by side with llama.cpp (bench/engine_vs_llamacpp.py's). Registered by bench/perf_doc.py,
which renders and checks every table."""
from __future__ import annotations

from bench.perf_doc_format import pct


def engine_roofline(result: dict) -> list[list[str]]:
    rows = [["dtype", "phase", "tok/s", "GFLOPS", "of peak", "GB/s", "bound", "of its roof"]]
    for dtype in result["dtypes"]:
        for phase, label in (("b1", "batch 1"), ("b32", f"batch {result['workload']['batch']}")):
            key = f"{phase}_{dtype}"
            of_peak = pct(result[f"of_peak_{key}"], 0)
            rows.append([dtype, label, f"{result[f'tok_s_{key}']:.1f}", f"{result[f'achieved_gflops_{key}']:.1f}",
                         f"**{of_peak}**" if phase == "b32" else of_peak, f"{result[f'achieved_gb_s_{key}']:.1f}",
                         result[f"bound_{key}"], pct(result[f"of_roof_{key}"], 0)])
    return rows


def engine_vs_llamacpp(result: dict) -> list[list[str]]:
    rows = [["dtype", "batch", "llama.cpp tok/s", "ours tok/s", "ours / llama.cpp", "decode roof tok/s",
             "llama.cpp of roof", "ours of roof", "with prefill: ours / llama.cpp"]]
    for dtype in result["dtypes_done"]:
        for batch in result["batches"]:
            key = f"b{batch}_{dtype}"
            rows.append([dtype, str(batch), f"{result[f'llamacpp_tok_s_{key}']:.1f}",
                         f"{result[f'ours_tok_s_{key}']:.1f}", f"**{result[f'ratio_{key}']:.2f}**",
                         f"{result[f'roof_tok_s_{key}']:.0f}", f"{100 * result[f'llamacpp_of_roof_{key}']:.0f}%",
                         f"{100 * result[f'ours_of_roof_{key}']:.0f}%", f"{result[f'ratio_e2e_{key}']:.2f}"])
    return rows


def engine_per_core(result: dict) -> list[list[str]]:
    """The README's engine line: decode tokens per second per core, ours and llama.cpp's."""
    threads = result["threads"]
    rows = [["decode tok/s per core (ours / llama.cpp)"] + [f"batch {b}" for b in result["batches"]]]
    for dtype in result["dtypes_done"]:
        rows.append([dtype] + [f"{result[f'ours_tok_s_b{b}_{dtype}'] / threads:.0f} / "
                               f"{result[f'llamacpp_tok_s_b{b}_{dtype}'] / threads:.0f}" for b in result["batches"]])
    return rows
