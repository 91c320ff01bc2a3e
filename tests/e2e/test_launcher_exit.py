"""Services started by LocalCluster never outlive their launcher, however it ends (SIGKILL
included): each sets PR_SET_PDEATHSIG itself at start-up (services/local/cluster.py)."""
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
from services.local.cluster import LocalCluster
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


def outliving(parent: subprocess.Popen, children: list[int]) -> list[int]:
    """SIGKILL `parent`; the children still alive 30 s later."""
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in children if alive(pid)]


def test_services_exit_when_their_launcher_is_killed():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(root=str(ROOT))],
                                stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(pids) == 3 and all(alive(pid) for pid in pids)
        assert not outliving(launcher, pids), "services outlived their launcher"
    finally:
        launcher.kill()


BENCHMARK = """
import asyncio, sys
sys.path.insert(0, {root!r})
from bench.loadgen import Front, Job, run_clients
# Jobs due in ten minutes, to a port nothing listens on: the clients wait, as a flood's do.
jobs = [Job(priority, "hi", 1, 1, at=600.0) for priority in ("high", "low")]
asyncio.run(run_clients(Front("grpc", "127.0.0.1:9"), jobs))
"""


def sending_clients(pid: int) -> list[int]:
    """The benchmark's client processes that are past start-up, in their sending loop (gRPC's
    extension loaded): killed earlier, they would end anyway, on the pipe their parent closed."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    try:
        return [child for child in children if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()
                and "cygrpc" in Path(f"/proc/{child}/maps").read_text()]
    except OSError:          # one ended meanwhile
        return []


def test_benchmark_clients_exit_when_the_benchmark_is_killed():
    # A killed benchmark runs no cleanup; its client processes must not go on loading the
    # cluster (and keeping its draining services waiting for their streams).
    benchmark = subprocess.Popen([sys.executable, "-c", BENCHMARK.format(root=str(ROOT))])
    try:
        deadline = time.monotonic() + 60
        while len(clients := sending_clients(benchmark.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(clients) == 2, f"expected a client process per priority, found {clients}"
        time.sleep(1.0)         # the start time sent, the clients waiting for their jobs' time
        assert not outliving(benchmark, clients), "clients outlived their benchmark"
    finally:
        benchmark.kill()
