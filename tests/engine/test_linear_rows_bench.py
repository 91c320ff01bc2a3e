"""bench/linear_rows.py: this checkout's linear kernel against a commit's, on a model's shapes,
with the outputs checked equal before anything is timed."""
from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch

from bench import linear_rows
from services.engine.config import load_model_config
from services.engine.linear_kernel import load_linear_kernel
from tests.engine.conftest import built_kernel

ROOT = Path(__file__).resolve().parents[2]


def test_layer_shapes_are_the_engines_fused_projections(tiny_model_dir):
    c = load_model_config(tiny_model_dir)
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    assert linear_rows.layer_shapes(c) == [(qkv, c.hidden_size), (c.hidden_size, c.num_heads * c.head_dim),
                                           (2 * c.intermediate_size, c.hidden_size),
                                           (c.hidden_size, c.intermediate_size)]


def test_head_against_itself_is_level_and_equal(tiny_model_dir, tmp_path):
    kernel = built_kernel(load_linear_kernel, "linear kernel")
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout: no commit to take the other kernel from")
    dtype = "bfloat16" if torch.bfloat16 in kernel.dtypes else "float32"
    result = linear_rows.main(["--against", "HEAD", "--model", str(tiny_model_dir), "--dtype", dtype,
                               "--rows", "1,9,17", "--rounds", "2", "--threads", "1",
                               "--json", str(tmp_path / "rows.json")])
    assert [r["rows"] for r in result["results"]] == [1, 9, 17]
    assert all(math.isfinite(r["ratio"]) and r["this_ms"] > 0 and r["other_ms"] > 0 for r in result["results"])
    assert (tmp_path / "rows.json").exists()
