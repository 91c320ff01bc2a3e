"""`qos-serve up` supervises its processes: a worker SIGKILLed under load is restarted while the
other worker keeps serving, every request completes, the restart is counted on the router's
/metrics, and the pool has both workers again. SIGTERM still drains and stops everything.
(Backoff and giving up after repeated crashes: tests/unit/test_supervisor.py.)"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.common.cluster_auth import ClusterTrust
from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool
from services.common.ports import free_port
from services.common.proto.qos.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.tools import tokens
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import bench_model, run

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> dict[int, str]:
    """pid -> command line of each child process of `pid`."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                out[int(child)] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                pass
    return out


def worker_pid(launcher: int, index: int) -> int | None:
    return next((pid for pid, line in children(launcher).items()
                 if " worker " in line and f"--index {index} " in line), None)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def test_a_killed_worker_is_restarted_and_the_cluster_keeps_serving(tmp_path):
    router = RouterConfig(port=free_port(), http_port=-1, metrics_port=free_port())
    config = single_pool(router=router, scheduler=SchedulerConfig(port=free_port()),
                         workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=64) for _ in range(2)],
                         model=bench_model())
    tokens.init(tmp_path / "tokens")
    config.security.tokens_dir = str(tmp_path / "tokens")
    trust = ClusterTrust.load(config.security, "admin")
    config.write_json(tmp_path / "cluster.json")
    launcher = subprocess.Popen([sys.executable, "-m", "services.tools.cli", "up", "--config",
                                 str(tmp_path / "cluster.json")], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        line = launcher.stdout.readline()
        assert line.startswith("qos-serve up: router"), line + launcher.stderr.read()
        first = wait_for(lambda: worker_pid(launcher.pid, 0), 10, "worker 0")

        async def load():
            async with RouterClient(router.address) as client:
                async def one(i):
                    await asyncio.sleep(0.2 * i)
                    return await client.generate(chat_request(f"Tell me about the number {i}.",
                                                              sampling_params(max_tokens=24, ignore_eos=True)),
                                                 priority=("high", "medium", "low")[i % 3])
                tasks = [asyncio.create_task(one(i)) for i in range(30)]
                await asyncio.sleep(1.0)
                os.kill(first, signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), 180)

        answers = run(load())
        assert all(len(a.token_ids) == 24 for a in answers)
        assert launcher.poll() is None, "the launcher stopped the cluster"

        second = wait_for(lambda: worker_pid(launcher.pid, 0), 30, "worker 0 restarted")
        assert second != first

        async def workers() -> int:
            async with trust.channel(config.pools[0].scheduler.address, "scheduler") as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                return (await stub.GetPoolStats(scheduler_pb2.PoolStatsRequest(), metadata=trust.metadata)).workers
        wait_for(lambda: run(workers()) == 2, 120, "the restarted worker back in the pool")
        scraped = metrics(router.metrics_port)
        assert 'qos_process_restarts_total{process="cpu/worker-0"} 1.0' in scraped
        assert 'qos_process_up{process="cpu/worker-0"} 1.0' in scraped
        assert 'qos_process_restarts_total{process="router"} 0.0' in scraped

        async def after():
            async with RouterClient(router.address) as client:
                return await client.generate(chat_request("And now?", sampling_params(max_tokens=8)),
                                             priority="high")
        assert run(after()).token_ids
    finally:
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err[-2000:]
    assert "supervisor: cpu/worker-0 exited with code -9; restarting in 1 s" in err
    assert "stopped" in out
