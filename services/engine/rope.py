"""Rotary position embeddings: the cos/sin tables, built once per model, looked up by position.

Positions past the model's context window occur only in streaming mode (the text position of a
long document's token: services/common/stream_window.py); their angles are computed when asked,
in float64, since an fp32 product of a large position and a frequency is off by up to ~1e-3 rad.
"""
from __future__ import annotations

import math

import torch

from services.engine.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are stretched by `factor`, short ones kept, a smooth ramp between.
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryTable:
    """cos/sin for every position up to the context window, in the model's dtype."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype):
        inv_freq = inverse_frequencies(config)
        self._inv_freq64 = inv_freq.double().to(device)
        self.dtype = dtype
        positions = torch.arange(config.max_context, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        # sin with its first half negated: rotate_half(x) * sin == roll(x, half) * signed_sin,
        # bit for bit (negation is exact), without the negate and the concatenation per call.
        sin = angles.sin()
        half = sin.shape[-1] // 2
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor, max_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for `positions` [T], shaped [T, 1, head_dim] to broadcast over heads.
        `max_position`: the largest of them, when it may lie past the table."""
        length = self.cos.shape[0]
        if max_position < length:
            return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)
        cos, sin = self.cos[positions.clamp(max=length - 1)], self.signed_sin[positions.clamp(max=length - 1)]
        far = positions >= length
        freqs = positions[far].double().unsqueeze(1) * self._inv_freq64
        angles = torch.cat((freqs, freqs), dim=-1)
        half = angles.shape[-1] // 2
        signed = angles.sin()
        signed[:, :half].neg_()
        cos[far], sin[far] = angles.cos().to(self.dtype), signed.to(self.dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] with the rotate-half convention of Hugging Face checkpoints
    (x * cos + rotate_half(x) * sin); `signed_sin` from RotaryTable.lookup."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1)
    return x * cos + rotated * signed_sin
