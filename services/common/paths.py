"""Where qos-serve keeps what it makes once and reuses (converted models, the default database), and
the source checkout it runs from."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$QOS_SERVE_CACHE, else $XDG_CACHE_HOME/qos-serve, else ~/.cache/qos-serve."""
    if os.environ.get("QOS_SERVE_CACHE"):
        return Path(os.environ["QOS_SERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qos-serve"


def source_checkout() -> Path | None:
    """The repository this `services` package runs from (bench/, configs/ beside it), or None when it
    was installed without its source tree (a wheel in site-packages has no pyproject.toml beside it)."""
    root = Path(__file__).resolve().parents[2]      # services/common/paths.py -> the repository
    return root if (root / "pyproject.toml").is_file() and (root / "services").is_dir() else None
