"""The measured tables of docs/performance.md, docs/operations.md and README.md are their JSON under
bench/results/, rendered (bench/perf_doc.py): a figure edited by hand, or a JSON measured again
without its page, fails here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import perf_doc

ROOT = Path(__file__).resolve().parents[2]
HAND_WRITTEN_TABLES = ["| script | what it compares |"]      # docs/performance.md's, without figures


def read(page: str) -> str:
    return (ROOT / page).read_text()


@pytest.mark.parametrize("page", perf_doc.PAGES)
def test_the_page_is_its_json_rendered(page):
    text = read(page)
    assert text == perf_doc.render_page(text), "run: python -m bench.perf_doc --write"


def test_every_table_is_on_one_page_once():
    names = [name for page in perf_doc.PAGES for name in perf_doc.tables_in(read(page))]
    assert sorted(names) == sorted(perf_doc.TABLES)


def test_the_performance_page_has_no_table_of_figures_written_by_hand():
    assert perf_doc.unrendered_tables(read("docs/performance.md")) == HAND_WRITTEN_TABLES


def test_a_figure_edited_by_hand_differs_from_the_rendering():
    text = read("docs/performance.md")
    row = next(line for line in perf_doc.BLOCK.search(text)[0].splitlines()
               if line.startswith("|") and re.search(r"\d", line) and not line.startswith("|-"))
    digit = re.search(r"\d", row)
    edited_row = row[:digit.start()] + str((int(digit[0]) + 1) % 10) + row[digit.end():]
    edited = text.replace(row, edited_row, 1)
    assert edited != text and perf_doc.render_page(edited) == text


def test_a_marker_names_a_table_the_script_renders():
    with pytest.raises(ValueError, match="no table 'nope'"):
        perf_doc.render_page("<!-- table: nope (rendered from nothing) -->\n| 1 |\n<!-- /table -->")


def test_every_result_a_page_links_to_exists():
    pages = ["README.md"] + [str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")]
    linked = {m for page in pages for m in re.findall(r"\]\((?:\.\./)?(bench/results/[\w./-]+)\)", read(page))}
    assert linked and not [path for path in sorted(linked) if not (ROOT / path).exists()]


def test_the_engines_cache_capacity_is_the_one_the_table_names():
    source = read("services/engine/linear.py")
    assert int(re.search(r"^CACHE_CAPACITY = (\d+)", source, re.M)[1]) == perf_doc.ENGINE_CACHE_CAPACITY
