"""A CPU engine bounds oneDNN's and ideep's primitive caches before it builds its first primitive
(services/engine/linear.py), and keeps an operator's own setting. Each case runs in a fresh
process: both libraries read the variables once, at their first primitive."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from services.engine.linear import CACHE_CAPACITY

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, os, sys
import torch
torch.set_num_threads(1)
from tests.tiny_models import make_engine
make_engine(sys.argv[1])
print(json.dumps({n: os.environ.get(n) for n in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}))
"""


def capacities_after_engine(model_dir, **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    done = subprocess.run([sys.executable, "-c", PROBE, str(model_dir)], capture_output=True, text=True,
                          cwd=ROOT, env={**clean, **env}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_engine_bounds_the_primitive_caches(tiny_model_dir):
    assert capacities_after_engine(tiny_model_dir) == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(CACHE_CAPACITY), "LRU_CACHE_CAPACITY": str(CACHE_CAPACITY)}


def test_an_operators_setting_is_kept(tiny_model_dir):
    got = capacities_after_engine(tiny_model_dir, ONEDNN_PRIMITIVE_CACHE_CAPACITY="16", LRU_CACHE_CAPACITY="32")
    assert got == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "32"}
