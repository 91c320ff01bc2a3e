"""bench/attention_rows.py: this checkout's paged attention kernel against a commit's, on a model's
shapes, with the outputs checked equal before anything is timed."""
from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch

from bench import attention_rows
from services.engine.paged_attention import load_paged_kernel
from tests.engine.conftest import built_kernel

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case, parsed", [("d21x300", ("d", 21, 300)), ("p128x128", ("p", 128, 128)),
                                          ("p32x2048", ("p", 32, 2048))])
def test_cases_parse(case, parsed):
    assert attention_rows.parse_case(case) == parsed


@pytest.mark.parametrize("case", ["d0x10", "d3x0", "p20x10", "x3x4", "d3"])
def test_bad_cases_are_refused(case):
    with pytest.raises(ValueError, match="dNxL"):
        attention_rows.parse_case(case)


@pytest.mark.parametrize("layout", attention_rows.LAYOUTS)
def test_layouts_place_the_same_keys_and_values(tiny_model_dir, layout):
    """Each layout gives every sequence blocks of its own, in the order the layout says, holding
    the same keys and values: the kernel's output does not depend on the layout."""
    from services.engine.config import load_model_config
    kernel = built_kernel(load_paged_kernel, "paged attention kernel")
    config = load_model_config(tiny_model_dir)
    work = attention_rows.Case("d3x40", config, 2, torch.float32, torch.Generator().manual_seed(0))
    placed = work.placed(layout, torch.Generator().manual_seed(1))
    blocks = placed.tables.flatten().tolist()
    assert sorted(blocks) == list(range(len(blocks)))          # every block once
    steps = {b - a for row in placed.tables.tolist() for a, b in zip(row, row[1:])}
    assert steps == {"ascending": {1}, "descending": {-1}}.get(layout, steps)
    assert torch.equal(placed.run(kernel, 1), work.placed("ascending", torch.Generator()).run(kernel, 1))
    chunk = attention_rows.Case("p8x20", config, 1, torch.float32, torch.Generator().manual_seed(0))
    placed = chunk.placed(layout, torch.Generator().manual_seed(1))
    assert chunk.lengths.tolist() == list(range(13, 21)) and len(set(map(tuple, placed.tables.tolist()))) == 1


def test_head_against_itself_is_level_and_equal(tiny_model_dir, tmp_path):
    built_kernel(load_paged_kernel, "paged attention kernel")
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout: no commit to take the other kernel from")
    result = attention_rows.main(["--against", "HEAD", "--model", str(tiny_model_dir), "--dtype", "float32",
                                  "--cases", "d3x40,p8x20", "--rounds", "2", "--threads", "1",
                                  "--json", str(tmp_path / "rows.json")])
    assert [r["case"] for r in result["results"]] == ["d3x40", "p8x20"]
    assert all(math.isfinite(r["ratio"]) and r["this_ms"] > 0 and r["other_ms"] > 0 for r in result["results"])
    assert (tmp_path / "rows.json").exists()


def test_a_layout_against_another(tiny_model_dir):
    built_kernel(load_paged_kernel, "paged attention kernel")
    result = attention_rows.main(["--other-layout", "descending", "--layout", "ascending", "--model",
                                  str(tiny_model_dir), "--dtype", "float32", "--cases", "d3x40",
                                  "--rounds", "2", "--threads", "1"])
    assert result["other_layout"] == "descending" and result["against"] is None
    assert math.isfinite(result["results"][0]["ratio"])
