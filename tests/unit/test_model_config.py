"""Model folders are read, or refused with the unsupported field named."""
from __future__ import annotations

import pytest

from services.engine.config import UnsupportedModelError, parse_model_config

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 2048, "rope_theta": 500000.0,
    "eos_token_id": [1, 2], "hidden_act": "silu",
}


def test_llama_defaults_and_gqa():
    config = parse_model_config(LLAMA)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.rope_theta == 500000.0 and config.rope_scaling.rope_type == "default"
    assert config.eos_token_ids == (1, 2) and config.max_context == 2048


def test_generation_config_eos_wins():
    assert parse_model_config(LLAMA, {"eos_token_id": 7}).eos_token_ids == (7,)


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_llama3_rope_scaling_in_both_config_styles(key):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    if key == "rope_parameters":
        scaling["rope_theta"] = 500000.0
    config = parse_model_config({**LLAMA, key: scaling})
    assert config.rope_scaling.rope_type == "llama3" and config.rope_scaling.factor == 8.0
    assert config.rope_theta == 500000.0


def test_mistral_sliding_window_caps_the_context():
    raw = {**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
           "max_position_embeddings": 32768, "sliding_window": 4096}
    assert parse_model_config(raw).max_context == 4096
    assert parse_model_config({**raw, "sliding_window": None}).max_context == 32768


def test_qwen2_window_applies_only_when_enabled():
    raw = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
           "sliding_window": 1024, "use_sliding_window": False}
    assert parse_model_config(raw).max_context == 2048
    assert parse_model_config({**raw, "use_sliding_window": True}).max_context == 1024


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"model_type": "gemma"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type='dynamic'"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
])
def test_unsupported_fields_are_named(change, field):
    with pytest.raises(UnsupportedModelError, match=field.replace("[", r"\[")):
        parse_model_config({**LLAMA, **change})
