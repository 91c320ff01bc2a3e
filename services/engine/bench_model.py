"""The benchmark model: a small random-weight Llama with SmolLM2's tokenizer.

Serving benchmarks measure scheduling, not answer quality, so (like vLLM's and SGLang's
benchmarks with dummy weights) the QoS benchmark uses a model small enough that one High request
alone gets its first token in a few milliseconds on 2 CPU cores, while a burst of long Low prompts
still saturates the machine. Weights are drawn from a fixed seed, so every machine builds the same
model; outputs are forced to fixed lengths with ignore_eos. `--model` in the benchmark switches
to SmolLM2 or any folder.

    python -m services.engine.bench_model     # build it now and print the folder
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from services.common.paths import cache_root
from services.engine.default_model import default_model_dir

BENCH_MODEL_NAME = "qos-bench-llama-4L-256"
SEED = 1234
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def bench_model_dir() -> Path:
    target = cache_root() / "models" / BENCH_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    build_bench_model(target)
    return target


def build_bench_model(target: Path, config: dict = CONFIG, std: float = 0.02, seed: int = SEED) -> None:
    """A random-weight Llama of `config` (weights drawn from N(0, std) with `seed`) with SmolLM2's
    tokenizer, written to `target`."""
    import torch
    from safetensors.torch import save_file

    tokenizer_source = default_model_dir()
    c = config
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    h, inter = c["hidden_size"], c["intermediate_size"]
    tensors = {"model.embed_tokens.weight": weight(c["vocab_size"], h), "model.norm.weight": torch.ones(h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": weight(h, h), p + "self_attn.k_proj.weight": weight(kv, h),
            p + "self_attn.v_proj.weight": weight(kv, h), p + "self_attn.o_proj.weight": weight(h, h),
            p + "mlp.gate_proj.weight": weight(inter, h), p + "mlp.up_proj.weight": weight(inter, h),
            p + "mlp.down_proj.weight": weight(h, inter),
        })
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
        for name in TOKENIZER_FILES:
            if (tokenizer_source / name).is_file():
                shutil.copy(tokenizer_source / name, staging / name)
        staging.chmod(0o755)
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":
    print(bench_model_dir())
