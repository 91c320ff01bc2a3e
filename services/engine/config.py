"""Read a Hugging Face model folder's config.json into the few numbers the engine needs.

Only Llama-family decoders are supported (Llama, SmolLM2, Qwen2, Mistral). Anything that would
change the maths without us implementing it is refused with an error naming the field, so a model
never runs silently wrong.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The model folder describes something this engine does not implement."""


@dataclass(slots=True, frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_context: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for rotary embeddings")


def _rope_from_config(raw: dict) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes `rope_parameters` (theta included); older configs use
    # `rope_theta` + `rope_scaling`. Accept both.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        key = "rope_parameters" if "rope_parameters" in raw else "rope_scaling"
        raise UnsupportedModelError(
            f"unsupported {key}.rope_type={rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, RopeScaling()
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
    return theta, scaling


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def parse_model_config(raw: dict, generation_config: dict | None = None) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architectures={archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    model_type = raw.get("model_type", SUPPORTED_ARCHITECTURES[arch])
    if model_type != SUPPORTED_ARCHITECTURES[arch]:
        raise UnsupportedModelError(f"unsupported model_type={model_type!r} for {arch}")
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act={hidden_act!r}; only 'silu'")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("unsupported mlp_bias=true")
    if raw.get("pretraining_tp", 1) != 1:
        raise UnsupportedModelError(f"unsupported pretraining_tp={raw['pretraining_tp']}")
    quant = raw.get("quantization_config")
    if quant:
        raise UnsupportedModelError(
            f"unsupported quantization_config (quant_method={quant.get('quant_method')!r}); "
            "give a folder of unquantized safetensors")

    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    max_context = int(raw.get("max_position_embeddings", 2048))
    # A sliding window only differs from full attention beyond the window, so serving contexts up
    # to the window size is exact; longer contexts would need windowed attention we do not have.
    window = raw.get("sliding_window")
    sliding_active = window is not None and (model_type == "mistral" or raw.get("use_sliding_window"))
    if sliding_active:
        max_context = min(max_context, int(window))

    theta, scaling = _rope_from_config(raw)
    gen = generation_config or {}
    eos = _as_id_tuple(gen.get("eos_token_id", raw.get("eos_token_id")))
    return ModelConfig(
        architecture=arch,
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_context=max_context,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=eos,
        bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a model folder: config.json is missing")
    raw = json.loads(config_path.read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return parse_model_config(raw, gen)
