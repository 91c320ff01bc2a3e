"""Where qos-serve keeps what it makes once and reuses: converted models, the default database."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$QOS_SERVE_CACHE, else $XDG_CACHE_HOME/qos-serve, else ~/.cache/qos-serve."""
    if os.environ.get("QOS_SERVE_CACHE"):
        return Path(os.environ["QOS_SERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qos-serve"
