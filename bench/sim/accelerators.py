"""Step-time models of the accelerators the simulator's pools run on, for a Llama-3-8B-class
model in 16-bit weights (one replica per pool):

    step_ms = fixed_ms + ms_per_token * tokens computed in the step + ms_per_kv_token * KV tokens read

Where each figure comes from (public benchmarks and data sheets; +-30%: precision and software
versions differ between rows, so read the simulator's results as relative between routing modes,
not as absolute capacity):

- H100 SXM (3.35 TB/s HBM, 989 TFLOPS BF16): vLLM v0.6 on Llama-3-8B BF16 decodes 10 prompts at
  7.2 ms a step and prefills 1,369 tokens in 62 ms (LambdaLabsML/vllm-benchmark,
  results/prompt_10/1xH100-80GB-SXM); fixed 6.5 ms (weights 16.1 GB / 3.35 TB/s = 4.8 ms floor),
  0.035 ms a token, KV 128 KB a token / 3.35 TB/s = 0.04 us a token.
- A100 80GB SXM (2.04 TB/s, 312 TFLOPS): LMDeploy Llama-2-7B FP16 decodes at 9 ms a token at
  batch 1, prefills 2,048 tokens in 133-139 ms (InternLM/lmdeploy docs/en/benchmark/a100_fp16.md,
  NVIDIA TensorRT-LLM docs/source/performance.md); vLLM Llama-3-8B 11.5 ms a step: fixed 11.5 ms,
  0.065 ms a token, 0.08 us a KV token.
- Ascend 910B (64 GB, 1.6 TB/s, ~354 TFLOPS FP16): vLLM-Ascend serves a 7B model at an
  inter-token latency of 23 ms at low load (vllm-project/vllm-ascend issue #776); prefill from
  the roofline at 50% of peak, 0.09 ms a token; KV 128 KB / 1.6 TB/s = 0.1 us a token. The weakest
  figures here: no public MindIE table for 7-8B models was found.
- Xeon Sapphire Rapids, one socket with AMX (DDR5, ~250 GB/s achieved): Llama-2 BF16 with
  xFasterTransformer at 252 GB/s, and llama.cpp's AMX path at batch 1/16/256 (ggml-org/llama.cpp
  issue #2555, scaled from 13B to 8B): fixed 64 ms, 1.5 ms a token, 0.5 us a KV token.

KV capacity: device memory less weights (16 GB) and ~10% for activations, at 128 KB a token.
`local-cpu` is this machine's CPU worker on SmolLM2-135M (1 thread), measured, not published: its
figures are the step-time fit of a real `bench/cost_report.py` run (`bench/simulate.py --replay`).
"""
from __future__ import annotations

from dataclasses import dataclass

BLOCK_TOKENS = 16


@dataclass(slots=True, frozen=True)
class Accelerator:
    name: str
    device: str                      # cuda | npu | cpu: the router's device types
    fixed_ms: float
    ms_per_token: float
    ms_per_kv_token: float
    kv_tokens: int                   # KV cache capacity of one replica
    max_running: int                 # the pool scheduler's limits for it
    max_step_tokens: int

    def step_ms(self, tokens: int, kv_tokens: int) -> float:
        return self.fixed_ms + self.ms_per_token * tokens + self.ms_per_kv_token * kv_tokens

    @property
    def kv_blocks(self) -> int:
        return self.kv_tokens // BLOCK_TOKENS


ACCELERATORS = {a.name: a for a in [
    Accelerator("h100", "cuda", 6.5, 0.035, 0.00004, 450_000, 256, 2048),
    Accelerator("a100", "cuda", 11.5, 0.065, 0.00008, 450_000, 256, 2048),
    Accelerator("910b", "npu", 22.0, 0.09, 0.0001, 330_000, 128, 1024),
    Accelerator("xeon-spr", "cpu", 64.0, 1.5, 0.0005, 1_000_000, 32, 256),
]}


def local_cpu(fixed_ms: float, ms_per_token: float, ms_per_kv_token: float, kv_tokens: int,
              max_running: int, max_step_tokens: int) -> Accelerator:
    """This machine's CPU worker, from a step-time fit measured on a real run (bench/cost_report.py)."""
    return Accelerator("local-cpu", "cpu", fixed_ms, ms_per_token, ms_per_kv_token, kv_tokens, max_running,
                       max_step_tokens)
