"""bench/roofline.py's counting: the parameters of the checkpoint, the FLOPs and bytes of a step by
hand, the steps a real BatchRunner run records, and which roof a phase sits under."""
from __future__ import annotations

import pytest
import torch

from bench.engine_report import greedy_agreement
from bench.engine_workload import Request, StepRecorder, run_engine
from bench.roofline import StepWork, head_parameters, layer_parameters, phase_roofline, step_work
from services.engine.config import load_model_config
from tests.tiny_models import make_engine

MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_parameters_are_the_checkpoints(tiny_model_dir, tiny_reference):
    config = load_model_config(tiny_model_dir)
    layers = sum(p.numel() for name, p in tiny_reference.named_parameters()
                 if name.endswith(".weight") and name.split(".")[-2] in MATMULS)
    assert (layer_parameters(config), head_parameters(config)) == (layers, tiny_reference.lm_head.weight.numel())


def test_a_steps_flops_and_bytes_by_hand(tiny_model_dir):
    c = load_model_config(tiny_model_dir)        # 3 layers, 4 heads of 16, 2 kv heads, vocab 512, hidden 64
    layers, head = layer_parameters(c), head_parameters(c)
    # A decode at position 10 (11 keys) and a 3-token chunk at 0 that samples (1 + 2 + 3 keys).
    work = step_work(c, [(10, 1, True), (0, 3, True)], torch.float32)
    attention = 3 * 4 * 4 * 16 * (11 + 6)
    assert work.flops == 2 * layers * 4 + 2 * head * 2 + attention
    kv_per_token = 2 * 3 * 2 * 16 * 4
    assert work.bytes == (layers + head) * 4 + 10 * kv_per_token
    # A chunk that does not sample reads no output head; bf16 reads half the bytes.
    assert step_work(c, [(0, 3, False)], torch.bfloat16).bytes == layers * 2


def test_recorded_steps_count_every_computed_and_sampled_token(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    requests = [Request(list(range(100, 100 + p)), o) for p, o in ((20, 5), (7, 9), (40, 3))]
    recorder = StepRecorder(engine)
    run_engine(recorder, requests, max_running=2)
    entries = [e for step in recorder.steps for e in step]
    assert sum(n for _, n, _ in entries) == sum(len(r.prompt) + r.output_len - 1 for r in requests)
    assert sum(samples for *_, samples in entries) == sum(r.output_len for r in requests)


def test_a_phase_is_bound_by_the_roof_most_of_its_time_sits_under():
    peak, bandwidth = 100.0, 10.0                              # GFLOPS, GB/s: ridge at 10 FLOP/byte
    decode = StepWork(flops=1e9, bytes=1e9)                    # 0.01 s of compute, 0.1 s of memory
    prefill = StepWork(flops=20e9, bytes=1e9)                  # 0.2 s of compute, 0.1 s of memory
    point = phase_roofline([decode, prefill], seconds=0.6, peak_gflops=peak, bandwidth_gb_s=bandwidth)
    assert point.bound == "compute"                            # 0.2 s against 0.1 s
    assert point.roof_gflops == pytest.approx(21 / 0.3)         # the phase's FLOPs over 0.1 + 0.2 s
    assert (point.achieved_gflops, point.of_roof, point.of_peak) == pytest.approx((35.0, 0.5, 0.35))
    assert phase_roofline([decode] * 3, 0.3, peak, bandwidth).bound == "bandwidth"


def test_greedy_agreement_counts_tokens_up_to_the_first_difference():
    got = greedy_agreement([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 3], [4, 9, 6], [8]])
    assert got == {"tokens_before_first_difference": 3 + 1 + 0, "tokens": 7, "identical_requests": 1,
                   "requests": 3}
