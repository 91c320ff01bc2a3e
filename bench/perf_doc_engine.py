"""The engine's tables in docs/performance.md: its roofline (bench/engine_throughput.py's JSON) and
the side by side with llama.cpp (bench/engine_vs_llamacpp.py's). Registered by bench/perf_doc.py,
which renders and checks every table."""
from __future__ import annotations

from bench.perf_doc_format import pct


def engine_roofline(result: dict) -> list[list[str]]:
    runs = result["workload"].get("repeats", 1)
    decode = any(key.startswith("decode_of_roof_") for key in result)
    rows = [["dtype", "phase", "tok/s", "GFLOPS", "of peak", "GB/s", "bound", "of its roof"]
            + ([f"of its roof, {runs} runs", f"of peak, {runs} runs"] if runs > 1 else [])
            + (["decode steps alone: of their roof, each run"] if decode else [])]
    for dtype in result["dtypes"]:
        for phase, label in (("b1", "batch 1"), ("b32", f"batch {result['workload']['batch']}")):
            key = f"{phase}_{dtype}"
            of_peak = pct(result[f"of_peak_{key}"], 0)
            rows.append([dtype, label, f"{result[f'tok_s_{key}']:.1f}", f"{result[f'achieved_gflops_{key}']:.1f}",
                         f"**{of_peak}**" if phase == "b32" else of_peak, f"{result[f'achieved_gb_s_{key}']:.1f}",
                         result[f"bound_{key}"], pct(result[f"of_roof_{key}"], 0)]
                        + ([_spread(result[f"runs_{key}"], "of_roof"), _spread(result[f"runs_{key}"], "of_peak")]
                           if runs > 1 else [])
                        + ([_spread(result[f"runs_{key}"], "decode_of_roof")] if decode else []))
    return rows


def _spread(runs: list[dict], field: str) -> str:
    """Every run's share, in run order ("82, 71, 87%")."""
    return ", ".join(f"{100 * run[field]:.0f}" for run in runs) + "%"


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


# bench/engine_paired.py's runs, in the order they were taken: (JSON under bench/results, the
# change as the table names it, whether the engine kept it).
PAIRED_RUNS = (
    ("engine_paired_bf16_prepack.json", "bf16 linear layers on oneDNN, prepacked (off: F.linear)", "kept"),
    ("engine_paired_bf16_kernel.json", "bf16 caches read by the paged C decode kernel, with oneDNN's "
                                       "linear layers (off: gather + SDPA)", "not kept"),
    ("engine_paired_bf16_kernel_10_pairs.json", "", ""),
    ("engine_paired_linear_kernel_bf16_b1.json", "linear layers on the engine's C kernel "
                                                 "(off: oneDNN prepacked)", "kept"),
    ("engine_paired_linear_kernel_bf16_b8.json", "", ""),
    ("engine_paired_linear_kernel_bf16_b32.json", "", "(level)"),
    ("engine_paired_linear_kernel_f32_b1.json", "", ""),
    ("engine_paired_linear_kernel_f32_b32.json", "", "(level)"),
    ("engine_paired_bf16_kernel_after_linear_b1.json", "bf16 caches read by the paged C decode kernel, "
                                                       "with the linear kernel", "kept"),
    ("engine_paired_bf16_kernel_after_linear_b8.json", "", ""),
    ("engine_paired_huge_pages_f32_b1.json", "the linear kernel's weights in one buffer on 2 MiB pages "
                                             "(off: one allocation each)", "kept"),
    ("engine_paired_huge_pages_bf16_b1.json", "", "(no effect shown)"),
    ("engine_paired_huge_pages_bf16_b1_10_pairs.json", "", ""),
    ("engine_paired_bf16_norm_b1.json", "bf16 RMSNorm through the fused fp32 kernel, one cast "
                                        "(off: eight ops)", "not kept"),
    ("engine_paired_fused_layer_bf16_b1.json", "decode-only steps' layers in one C call each "
                                               "(off: torch's operations around the same kernels)", "kept"),
    ("engine_paired_fused_layer_bf16_b8.json", "", ""),
    ("engine_paired_fused_layer_bf16_b32.json", "", ""),
    ("engine_paired_fused_layer_f32_b1.json", "", ""),
    ("engine_paired_fused_layer_f32_b32.json", "", ""),
    ("engine_paired_batch_invariant_bf16_b8_p128.json", "prompt tokens attended by the paged decode kernel, "
                                                        "each as a decode of its position (off: SDPA); prompt "
                                                        "tok/s, 128-token prompts", "replaced (below)"),
    ("engine_paired_batch_invariant_f32_b8_p128.json", "", ""),
    ("engine_paired_batch_invariant_bf16_b1_p512.json", "the same, 512-token prompts", ""),
    ("engine_paired_batch_invariant_bf16_b1_p2048_t1.json", "the same, 2,048-token prompts, 1 thread", "(opt-in)"),
    ("engine_paired_prompt_kernel_bf16_b1_p512.json", "prompt chunks attended by the paged prompt kernel "
                                                      "(off: SDPA over the gathered context); prompt tok/s, "
                                                      "512-token prompts", "kept"),
    ("engine_paired_prompt_kernel_bf16_b1_p2048.json", "the same, 2,048-token prompts", ""),
    ("engine_paired_prompt_kernel_f32_b1_p2048.json", "", ""),
    ("engine_paired_prompt_kernel_bf16_b8_p128.json", "the same, 128-token prompts", ""),
    ("engine_paired_prompt_kernel_f32_b8_p128.json", "", ""),
    ("engine_paired_batch_invariant_bf16_b1_p2048_vs_prompt_kernel.json", "prompt tokens as decodes "
     "against the prompt kernel; 2,048-token prompts", ""),
    ("engine_paired_batch_invariant_prompt_kernel_bf16_b1.json", "batch invariance through the prompt kernel: "
     "decodes attended by it too (off: the decode kernel); decode tok/s, 128-token prompts",
     "kept, opt-in (numerics)"),
    ("engine_paired_batch_invariant_prompt_kernel_bf16_b32.json", "", ""),
    ("engine_paired_batch_invariant_prompt_kernel_f32_b32.json", "", ""),
    ("engine_paired_batch_invariant_prompt_kernel_bf16_b8_p1536.json", "the same, 1,536-token prompts", ""),
    ("engine_paired_batch_invariant_prompt_kernel_f32_b8_p1536.json", "", ""),
    ("engine_paired_batch_invariant_prompt_kernel_bf16_b1_p2048.json", "the same, prompt tok/s, 2,048-token "
     "prompts", "(opt-in; replaced below)"),
    ("engine_paired_commit_paged_attention_bf16_b1.json", "one paged kernel for decodes and prompts, over keys "
     "stored transposed in each block (off: the decode and prompt kernels, at 3dbb5da); decode tok/s, "
     "128-token prompts", "kept (batch-invariant by default)"),
    ("engine_paired_commit_paged_attention_bf16_b32.json", "", ""),
    ("engine_paired_commit_paged_attention_f32_b32.json", "", ""),
    ("engine_paired_commit_paged_attention_bf16_b8_p1536.json", "the same, 1,536-token prompts", ""),
    ("engine_paired_commit_paged_attention_f32_b8_p1536.json", "", ""),
    ("engine_paired_commit_paged_attention_bf16_b1_p2048.json", "the same, prompt tok/s, 2,048-token prompts", ""),
    ("engine_paired_commit_registers_width_avx2_f32_b1.json", "as a host without AVX-512 (AVX2 builds, torch held "
     "to AVX2): the kernels' vectors as wide as its registers (off: 16-wide, at 2e84a42); decode tok/s, "
     "128-token prompts", "kept"),
    ("engine_paired_commit_registers_width_avx2_f32_b8.json", "", ""),
    ("engine_paired_commit_tile_avx2_f32_b8_p1536.json", "the same host: a tile of 16 keys in two vectors (off: "
     "8 keys, one vector, at b38f0fc); decode tok/s, 1,536-token prompts", "kept"),
    ("engine_paired_commit_linear_ahead_bf16_b32.json", "the linear kernel asks for the next tile's weights while "
     "it computes a tile's rows, where they take more than one pass (off: at b0c6020); decode tok/s, 128-token "
     "prompts", "kept (bf16)"),
    ("engine_paired_commit_linear_ahead_bf16_b1.json", "", "(one pass: as before)"),
    ("engine_paired_commit_linear_ahead_f32_b32.json", "", "not kept (f32)"),
    ("engine_paired_fused_prompts_bf16_b32.json", "steps with prompt chunks in the fused layer too (off: the "
     "layer for decode-only steps, torch's operations around the same kernels for the others); prompt tok/s, "
     "128-token prompts", "kept"),
    ("engine_paired_fused_prompts_bf16_b8.json", "", ""),
    ("engine_paired_fused_prompts_f32_b32.json", "", ""),
    ("engine_paired_commit_c_layer_bf16_b32_prefill.json", "that, with the layer's bf16 SiLU and rotation "
     "vectorised (off: at dbffdb8); prompt tok/s", "kept"),
    ("engine_paired_commit_c_layer_bf16_b32.json", "the same; decode tok/s", "(level)"),
    ("engine_paired_commit_c_layer_bf16_b1.json", "", "(level)"),
    ("engine_paired_commit_block_order_bf16_b32_bench.json", "a freed sequence's KV blocks handed out again in "
     "their order, where a reused run came back reversed (off: at fc00587); make bench's batch-32 phase, tok/s",
     "kept (level here; the kernel 1.34-1.56x)"),
    ("engine_paired_commit_row_counts_bf16_b16_p1536.json", "attention micro-tiles of the rows they have, where "
     "a decode of a 3-query group computed 4 (off: at 9d38b6c); decode tok/s, 1,536-token prompts", "kept"),
    ("engine_paired_commit_keys_ahead_bf16_b16_p1536_scattered.json", "the keys of the block two on asked for "
     "at each jump between blocks (off: at bd75930); a scattered pool, decode tok/s, 1,536-token prompts",
     "kept"),
    ("engine_paired_commit_one_pass_ahead_bf16_b8.json", "the linear kernel's read-ahead in one pass over a "
     "tile's rows too, 2-8 rows (off: from 9 rows; at ee75ba9); decode tok/s, 128-token prompts", "kept"),
    ("engine_paired_commit_silu_in_gate_up_bf16_b32_bench.json", "SiLU applied in the gate/up projection's tiles "
     "(off: the projection stored, then SiLU; at fc00587); make bench's batch-32 phase, tok/s", "not kept"),
    ("engine_paired_commit_silu_in_gate_up_bf16_b1.json", "the same; decode tok/s, 128-token prompts", ""),
    ("engine_paired_commit_sampler_top_p_bf16_b32.json", "sampling by one uniform draw a row and top-p over "
     "the likeliest 128 / 1,024 tokens first (off: noise for every token, whole rows sorted; at 952cfc4); "
     "requests at temperature 0.7, top_p 0.95, decode tok/s", "kept"),
    ("engine_paired_commit_sampler_top_p_bf16_b1.json", "the same", ""),
    ("engine_paired_commit_sampler_temperature_bf16_b32.json", "the same; requests at temperature 1.0", ""),
)
PAIRED_SOURCES = tuple(source for source, _, _ in PAIRED_RUNS)
DTYPE_NAMES = {"float32": "f32", "bfloat16": "bf16"}


def engine_paired(*results: dict) -> list[list[str]]:
    rows = [["change", "dtype, batch", "on / off tok/s [95% interval]", "pairs", "kept"]]
    for (_, change, kept), r in zip(PAIRED_RUNS, results):
        low, high = r["ci95"]
        rows.append([change, f"{DTYPE_NAMES[r['dtype']]}, {r['batch']}",
                     f"{r['mean_ratio']:.3f} [{low:.3f}, {high:.3f}]", str(len(r["pairs"])), kept])
    return rows
