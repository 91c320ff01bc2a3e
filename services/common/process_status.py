"""The file in which a local cluster's supervisor says how its processes are (services/local/supervisor.py).

The launcher names the file to its children in PROCESSES_FILE_ENV; the router reads it for
/metrics and the console. Rows: name, pid, state (running | restarting | stopped), restarts,
last_exit_code. Written whole and renamed into place, so a reader never sees half a file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

PROCESSES_FILE_ENV = "QOS_SERVE_PROCESSES_FILE"
RUNNING, RESTARTING, STOPPED = "running", "restarting", "stopped"


def write_status(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"processes": rows}))
    os.replace(tmp, path)


def read_status(path: str | Path) -> list[dict]:
    """The rows last written; [] when there is no file (yet) or it cannot be read."""
    try:
        rows = json.loads(Path(path).read_text())["processes"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return rows if isinstance(rows, list) else []
