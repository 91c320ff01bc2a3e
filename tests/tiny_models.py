"""Tiny random Llama-family checkpoints written to a folder, with transformers as the reference."""
from __future__ import annotations

from pathlib import Path

import torch


def write_tiny_model(folder: Path, kind: str, seed: int = 0, init_std: float = 0.02) -> Path:
    """Save a small random model of `kind` ("llama" with GQA and llama3 rope scaling, or "qwen2"
    with q/k/v bias) in Hugging Face format; returns the folder. `init_std`: the weights' spread
    (transformers' default 0.02 leaves each layer's share of the logits small)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1, initializer_range=init_std)
    if kind == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                              "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        model = Qwen2ForCausalLM(config)
    else:
        raise ValueError(kind)
    # Random init leaves biases at zero; make them matter.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.eval()
    model.save_pretrained(folder)
    return Path(folder)


def make_engine(model_dir, num_blocks: int = 64, block_size: int = 16, dtype: str | None = "float32",
                **kwargs):
    """An engine over `model_dir` with exactly `num_blocks` KV blocks: fp32 on the CPU unless told
    otherwise (dtype=None: the device's own choice, which on a CPU with native bf16 is bf16, so
    tests that compare against the fp32 reference name fp32)."""
    from services.engine.config import load_model_config
    from services.engine.device import open_backend, resolve_dtype
    from services.engine.engine import Engine, EngineConfig
    from services.engine.kv_cache import bytes_per_block

    torch_dtype = resolve_dtype(dtype, open_backend(kwargs.get("device", "cpu")))
    per_block = bytes_per_block(load_model_config(model_dir), block_size, torch_dtype)
    return Engine(EngineConfig(model_dir=str(model_dir), kv_cache_bytes=num_blocks * per_block,
                               block_size=block_size, num_threads=1, dtype=dtype, **kwargs))


def reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(token_ids), vocab] for one unpadded sequence."""
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0].float()
