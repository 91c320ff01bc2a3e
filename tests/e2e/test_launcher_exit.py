"""Services started by LocalCluster never outlive their launcher, however it ends (SIGKILL
included): each sets PR_SET_PDEATHSIG itself at start-up (services/cluster.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = """
import sys, time
sys.path.insert(0, {root!r})
from services.cluster import LocalCluster
from tests.e2e.conftest import cluster_config
cluster = LocalCluster(cluster_config(), quiet=True).start()
print(" ".join(str(p.pid) for p in cluster.processes.values()), flush=True)
time.sleep(600)
"""

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but not yet reaped; /proc says which.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_services_exit_when_their_launcher_is_killed():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(root=str(ROOT))],
                                stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(pids) == 3 and all(alive(pid) for pid in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in pids if alive(pid)], "services outlived their launcher"
    finally:
        launcher.kill()
