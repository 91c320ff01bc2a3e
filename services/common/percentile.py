"""The one percentile used for every latency figure (stats RPCs, demo, benchmarks)."""
from __future__ import annotations

from collections.abc import Iterable


def percentile(values: Iterable[float], q: float, empty: float = 0.0) -> float:
    """Nearest-rank percentile, q in [0, 1]; `empty` when there are no values."""
    ordered = sorted(values)
    if not ordered:
        return empty
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
