"""Number formats every table of the docs shares (bench/perf_doc.py and the renderers beside it)."""
from __future__ import annotations

RESULTS = "bench/results"


def num(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def pct(share: float, digits: int = 1) -> str:
    return f"{100 * share:.{digits}f}%"
