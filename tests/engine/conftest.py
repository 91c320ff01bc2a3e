"""Fixtures for engine tests: tiny random checkpoints and their transformers reference models."""
from __future__ import annotations

import pytest
import torch

from services.engine.device import set_cpu_threads
from tests.tiny_models import make_engine, write_tiny_model

set_cpu_threads(1)  # tests set their thread count explicitly, like every torch process here


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def tiny_engine(tiny_model_dir):
    return make_engine(tiny_model_dir)
