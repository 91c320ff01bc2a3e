"""bench/engine_profile.py estimates matmul GFLOPS from the loaded model's linear layers; the
count must follow the engine's layout (fused q/k/v and gate/up, the output head in pieces)."""
from __future__ import annotations

from bench.engine_profile import layer_and_head_params
from services.engine import model as model_module
from tests.tiny_models import make_engine

MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_the_profile_counts_the_same_matmul_parameters_as_the_checkpoint(tiny_model_dir, tiny_reference,
                                                                         monkeypatch):
    monkeypatch.setattr(model_module, "LOGITS_PIECE_BYTES", 128 * 64 * 4)    # the head in 4 pieces
    engine = make_engine(tiny_model_dir)
    assert len(engine.model.lm_head) == 4
    layers = sum(p.numel() for name, p in tiny_reference.named_parameters()
                 if name.endswith(".weight") and name.split(".")[-2] in MATMULS)
    assert layer_and_head_params(engine.model) == (layers, tiny_reference.lm_head.weight.numel())
