"""Read a model folder's safetensors (single file or shards)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def load_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(load_file(str(path)))
    return tensors
