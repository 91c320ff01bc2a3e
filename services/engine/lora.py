"""LoRA adapters in PEFT's format, many in one batch.

An adapter folder holds `adapter_config.json` (r, lora_alpha, target_modules, optional
rank_pattern / alpha_pattern, use_rslora) and `adapter_model.safetensors` with
`base_model.model.model.layers.N.{self_attn,mlp}.X_proj.lora_{A,B}.weight`. For a projection W
with an adapter, y = x W^T + scale * (x A^T) B^T, scale = alpha / r (alpha / sqrt(r) with
rsLoRA). Anything PEFT can save that this does not compute is refused with the field named:
DoRA, modules_to_save, biases, Conv1D fan-in-fan-out, layer replication, embeddings, adapters
on other modules, or shapes that do not fit the base model.

Mixed batches (`LoraBatch`): the step's tokens are grouped by adapter (as S-LoRA's and Punica's
grouped path does): for each adapter present, its rows are gathered once per projection group,
x A^T is one matmul over the group's concatenated A (q, k and v share their input, as do gate
and up), each part's B adds into its slice of the fused output. Tokens without an adapter cost
nothing. The base model's matmuls are untouched.
"""
from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.config import ModelConfig

# Module name -> (the decoder's fused projection, part index within it).
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("out", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_REFUSED_TRUE = {"use_dora": "DoRA (use_dora) is not supported", "fan_in_fan_out": "fan_in_fan_out (Conv1D "
                 "layers) does not apply to Llama-family models", "lora_bias": "LoRA biases (lora_bias) are not supported"}


class AdapterError(ValueError):
    """An adapter this engine cannot serve; the message names the field or tensor."""


@dataclass(slots=True)
class FusedLora:
    """One adapter's low-rank update of one fused projection (e.g. q, k, v) in one layer, as two
    matmuls: x A^T, then B^T into the output columns o0:o1."""
    a: torch.Tensor                          # [sum of ranks, in]: every adapted part's A, stacked
    b: torch.Tensor                          # [o1 - o0, sum of ranks]: each part's B * scale in its
    o0: int                                  # own rows and rank columns, zeros elsewhere (block
    o1: int                                  # diagonal): one matmul for every part


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int                                # largest rank of any module
    targets: tuple[str, ...]                 # module names adapted
    layers: list[dict[str, FusedLora]]       # per layer: fused projection -> its update
    nbytes: int

    def to(self, device: torch.device) -> "LoraAdapter":
        moved = [{k: FusedLora(f.a.to(device), f.b.to(device), f.o0, f.o1) for k, f in layer.items()}
                 for layer in self.layers]
        return LoraAdapter(self.name, self.path, self.rank, self.targets, moved, self.nbytes)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _targeted(target_modules, module: str) -> bool:
    if isinstance(target_modules, str):                  # a regex over the whole name
        return re.fullmatch(target_modules, module) is not None
    return module.rsplit(".", 1)[-1] in target_modules or module in target_modules


def read_adapter_config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise AdapterError(f"{folder}: no adapter_config.json (a PEFT LoRA adapter folder)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{path}: not JSON: {exc}") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    for name, why in _REFUSED_TRUE.items():
        if config.get(name):
            raise AdapterError(f"{path}: {why}")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias is {config['bias']!r}; only \"none\" is supported")
    for name in ("modules_to_save", "layer_replication", "target_parameters", "trainable_token_indices"):
        if config.get(name):
            raise AdapterError(f"{path}: {name} is set ({config[name]!r}); only LoRA on the attention "
                               "and MLP projections is supported")
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise AdapterError(f"{path}: {name} must be a positive number, got {value!r}")
    if not config.get("target_modules"):
        raise AdapterError(f"{path}: target_modules is empty")
    return config


def load_peft_adapter(name: str, folder: str | Path, model: ModelConfig, dtype: torch.dtype) -> LoraAdapter:
    """Read and check one adapter on the host (CPU); `.to(device)` puts it where the model is."""
    from safetensors.torch import load_file
    folder = Path(folder)
    config = read_adapter_config(folder)
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise AdapterError(f"{folder}: no adapter_model.safetensors (adapters saved as .bin are not read: "
                           "save with safe_serialization=True)")
    tensors = load_file(str(weights_path))
    layers_to_transform = config.get("layers_to_transform")
    if isinstance(layers_to_transform, int):
        layers_to_transform = [layers_to_transform]
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{weights_path.name}: tensor {key!r} is not a LoRA A/B weight of an attention "
                               "or MLP projection (embeddings, DoRA magnitudes and saved modules are not supported)")
        layer, _, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in TARGETS:
            raise AdapterError(f"{weights_path.name}: tensor {key!r} adapts {module}, not one of {', '.join(TARGETS)}")
        if layer >= model.num_layers:
            raise AdapterError(f"{weights_path.name}: tensor {key!r} is for layer {layer}, but the model has "
                               f"{model.num_layers} layers (base_model_name_or_path: "
                               f"{config.get('base_model_name_or_path')!r})")
        found.setdefault((layer, module), {})[which] = tensor
    if not found:
        raise AdapterError(f"{weights_path.name}: no LoRA weights")
    c = model
    out_sizes = {"q_proj": c.num_heads * c.head_dim, "k_proj": c.num_kv_heads * c.head_dim,
                 "v_proj": c.num_kv_heads * c.head_dim, "o_proj": c.hidden_size,
                 "gate_proj": c.intermediate_size, "up_proj": c.intermediate_size, "down_proj": c.hidden_size}
    in_sizes = {m: (c.num_heads * c.head_dim if m == "o_proj" else c.intermediate_size if m == "down_proj"
                    else c.hidden_size) for m in TARGETS}
    offsets = {"q_proj": 0, "k_proj": out_sizes["q_proj"], "v_proj": out_sizes["q_proj"] + out_sizes["k_proj"],
               "o_proj": 0, "gate_proj": 0, "up_proj": c.intermediate_size, "down_proj": 0}
    layers: list[dict[str, FusedLora]] = [{} for _ in range(model.num_layers)]
    pending: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor, str]]] = {}
    rank_max, targets, nbytes = 0, set(), 0
    for (layer, module), pair in sorted(found.items()):
        full = f"model.layers.{layer}.{'self_attn' if module[0] in 'qkvo' else 'mlp'}.{module}"
        where = f"{weights_path.name}: {full}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where} has lora_{next(iter(pair))} but not its pair")
        if not _targeted(config["target_modules"], full) or (
                layers_to_transform is not None and layer not in layers_to_transform):
            raise AdapterError(f"{where} has weights but target_modules / layers_to_transform do not name it")
        a, b = pair["A"], pair["B"]
        rank = _pattern_value(config.get("rank_pattern") or {}, full, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, full, config["lora_alpha"])
        if a.shape != (rank, in_sizes[module]) or b.shape != (out_sizes[module], rank):
            raise AdapterError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit rank {rank} and this "
                f"model's {module} ({in_sizes[module]} -> {out_sizes[module]}): a base model mismatch? "
                f"(base_model_name_or_path: {config.get('base_model_name_or_path')!r})")
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        # Scale folded into B once, in fp32, then cast: one multiply fewer per step.
        pending.setdefault((layer, TARGETS[module][0]), []).append(
            (a.to(dtype), (b.float() * scale).to(dtype), module))
        rank_max, targets = max(rank_max, rank), targets | {module}
        nbytes += (a.numel() + b.numel()) * torch.tensor([], dtype=dtype).element_size()
    for (layer, fused), parts in pending.items():
        parts.sort(key=lambda p: TARGETS[p[2]][1])
        o0 = min(offsets[m] for _, _, m in parts)
        o1 = max(offsets[m] + out_sizes[m] for _, _, m in parts)
        b_all = torch.zeros(o1 - o0, sum(a.shape[0] for a, _, _ in parts), dtype=dtype)
        start = 0
        for a, b, module in parts:
            rows = offsets[module] - o0
            b_all[rows:rows + out_sizes[module], start:start + a.shape[0]] = b
            start += a.shape[0]
        layers[layer][fused] = FusedLora(torch.cat([a for a, _, _ in parts]), b_all, o0, o1)
    return LoraAdapter(name, str(folder), rank_max, tuple(sorted(targets)), layers, nbytes)


@dataclass(slots=True)
class LoraBatch:
    """Which rows of a step's flat batch use which adapter (rows without one are absent): a
    contiguous run of rows as a slice (views, no copy: a prefill chunk), else an index tensor."""
    groups: list[tuple[LoraAdapter, torch.Tensor | slice]]

    def apply(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the base projection of x) plus each adapter's update on its own rows."""
        for adapter, rows in self.groups:
            update = adapter.layers[layer].get(fused)
            if update is None:
                continue
            if isinstance(rows, slice):
                out[rows, update.o0:update.o1] += (x[rows] @ update.a.T) @ update.b.T
            else:
                out[:, update.o0:update.o1].index_add_(0, rows, (x.index_select(0, rows) @ update.a.T) @ update.b.T)
        return out


class AdapterSet:
    """The adapters an engine holds: every loaded one as a host copy (least recently used first,
    at most max_cpu_loras), and at most max_loras of them on the device, moved there when a step
    first needs one (least recently used out first, never one the step needs; a no-op on CPU)."""

    def __init__(self, device: torch.device, max_loras: int, max_cpu_loras: int):
        self.device, self.max_loras, self.max_cpu_loras = device, max_loras, max_cpu_loras
        self.loaded: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.on_device: OrderedDict[str, LoraAdapter] = OrderedDict()

    def __contains__(self, name: str) -> bool:
        return name in self.loaded

    def __iter__(self):
        return iter(self.loaded)

    def __len__(self) -> int:
        return len(self.loaded)

    def values(self):
        return self.loaded.values()

    def add(self, adapter: LoraAdapter, in_use: set[str] = frozenset()) -> list[str]:
        """Load (or replace) one; past max_cpu_loras drop the least recently used adapters no
        sequence uses (`in_use`), returning their names; refuse when all of them are in use."""
        if adapter.name not in self.loaded and len(self.loaded) >= self.max_cpu_loras \
                and all(name in in_use for name in self.loaded):
            raise AdapterError(f"{len(self.loaded)} adapters are loaded, all in use: max_cpu_loras is "
                               f"{self.max_cpu_loras}; unload one or wait")
        self.loaded.pop(adapter.name, None)
        self.on_device.pop(adapter.name, None)            # a new version replaces the old
        self.loaded[adapter.name] = adapter
        dropped = [name for name in self.loaded if name != adapter.name and name not in in_use]
        dropped = dropped[:max(0, len(self.loaded) - self.max_cpu_loras)]
        for name in dropped:
            self.remove(name)
        return dropped

    def remove(self, name: str) -> None:
        if self.loaded.pop(name, None) is None:
            raise AdapterError(f"adapter {name!r} is not loaded")
        self.on_device.pop(name, None)

    def _on_device(self, name: str, needed: set[str]) -> LoraAdapter:
        if name in self.on_device:
            self.on_device.move_to_end(name)
        else:
            while len(self.on_device) >= self.max_loras:
                del self.on_device[next(n for n in self.on_device if n not in needed)]
            self.on_device[name] = self.loaded[name].to(self.device)
        self.loaded.move_to_end(name)
        return self.on_device[name]

    def batch(self, rows: dict[str, list[int]]) -> LoraBatch:
        """The step's groups (adapter -> its rows of the flat batch), every adapter on the device."""
        needed = set(rows)
        return LoraBatch([(self._on_device(name, needed),
                           slice(r[0], r[-1] + 1) if r[-1] - r[0] + 1 == len(r) else torch.tensor(r, device=self.device))
                          for name, r in rows.items()])
