"""Loading model folders and sizing the KV cache."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine.config import UnsupportedModelError, load_model_config
from services.engine.device import DeviceUnavailableError, open_backend, resolve_device, resolve_dtype
from services.engine.engine import Engine, EngineConfig
from services.engine.kv_cache import bytes_per_block, size_kv_cache
from tests.tiny_models import make_engine


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_kv_cache_sized_from_budget(tiny_model_dir):
    config = load_model_config(tiny_model_dir)
    # 2 (K, V) x 3 layers x 16 tokens x 2 kv heads x 16 dims x 4 bytes
    assert bytes_per_block(config, 16, torch.float32) == 2 * 3 * 16 * 2 * 16 * 4
    spec = size_kv_cache(config, torch.float32, budget_bytes=10 * 12288 + 5)
    assert (spec.num_blocks, spec.block_size, spec.bytes_per_block) == (10, 16, 12288)
    assert "10 KV blocks x 16 tokens" in spec.describe()
    with pytest.raises(ValueError, match="smaller than one block"):
        size_kv_cache(config, torch.float32, budget_bytes=100)
    engine = make_engine(tiny_model_dir, num_blocks=37, block_size=8)
    assert (engine.kv_spec.num_blocks, engine.kv_spec.block_size) == (37, 8)
    assert engine.cache.values[0].shape == (37 * 8, 2, 16)
    assert engine.cache.keys[0].shape == ((37, 2, 16, 8) if engine.cache.keys_transposed else (37 * 8, 2, 16))


def test_kv_cache_sized_from_free_memory_fraction(tiny_model_dir):
    engine = Engine(EngineConfig(model_dir=str(tiny_model_dir), kv_cache_fraction=0.001, num_threads=1))
    assert engine.kv_spec.num_blocks > 1


def test_unknown_rope_type_refused_at_load(tiny_model_dir, tmp_path):
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="rope_type='yarn'"):
        make_engine(folder)


def test_unexpected_and_missing_tensors_named(tiny_model_dir, tmp_path):
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    path = folder / "model.safetensors"
    tensors = load_file(path)
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, path)
    with pytest.raises(UnsupportedModelError, match="does not use: model.layers.0.self_attn.q_norm"):
        make_engine(folder)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(UnsupportedModelError, match="missing tensor 'model.layers.1.mlp.down_proj"):
        make_engine(folder)


def test_folder_without_config_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_model_config(tmp_path)


def test_devices_and_dtypes():
    cpu = open_backend("cpu")
    assert resolve_device("cpu").type == "cpu"
    assert resolve_dtype(None, cpu) == cpu.preferred_dtype     # by the CPU's flags (test_bf16.py)
    assert resolve_dtype("fp32", cpu) == torch.float32
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported device 'tpu'"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8", cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_absent_is_a_clear_error():
    with pytest.raises(DeviceUnavailableError, match="CUDA is not available"):
        resolve_device("cuda:0")


def test_npu_without_the_ascend_stack_is_a_clear_error():
    pytest.importorskip("torch")
    try:
        import torch_npu  # noqa: F401
        pytest.skip("torch_npu is importable here")
    except Exception:
        pass
    with pytest.raises(DeviceUnavailableError, match="Ascend stack is missing"):
        resolve_device("npu:0")
