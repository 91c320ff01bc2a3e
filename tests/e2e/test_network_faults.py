"""Network faults between the cluster's processes, in a network namespace this test creates (its
own loopback, 127.0.0.1, nothing else reachable): packet loss on every hop, and a partition
between the scheduler and one worker, then healed. No request is lost, no token duplicated or
skipped: every stream continues from exactly the tokens its client holds, and in fp32 every text
equals the fault-free run's; after the partition heals the worker is back.

The cluster runs in tests/e2e/netns_driver.py under `ip netns exec`. Faults are iptables rules
in that namespace (Debian's iptables; `.ci/run` installs it). Delay comes from a proxy on the
scheduler-worker hop (50 ms each way, up to 20 ms jitter): this machine's kernel has no
`sch_netem` (tc answers "Specified qdisc kind is unknown"). Skips, saying why, where namespaces
cannot be made (not root, no iproute2 or iptables)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.e2e.conftest import texts_are_batch_invariant
from tests.e2e.test_failover import DTYPES, assert_held

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def namespace_or_skip() -> str:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (Debian's iproute2 / iptables; .ci/run installs them)")
    name = f"qos-test-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
    probe = subprocess.run(["ip", "netns", "exec", name, "iptables", "-L", "INPUT"], capture_output=True, text=True)
    if probe.returncode != 0:
        subprocess.run(["ip", "netns", "del", name])
        pytest.skip(f"iptables does not work in a namespace here: {probe.stderr.strip()}")
    return name


@pytest.fixture
def namespace():
    name = namespace_or_skip()
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name])


def run_fault(namespace: str, fault: str, tmp_path: Path, dtype: str = "fp32") -> dict:
    out = tmp_path / f"{fault}.json"
    done = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "tests/e2e/netns_driver.py",
                           fault, str(out), dtype], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def assert_same_texts(result: dict) -> None:
    for phase in ("during", "after"):
        for ref, got in zip(result["reference"], result[phase]):
            assert got["finish_reason"] and got["completion_tokens"] == len(got["tokens"]) == len(ref["tokens"])
            assert got["tokens"] == ref["tokens"] and got["text"] == ref["text"], phase


def assert_streams_held(result: dict, dtype: str) -> None:
    """Batch-invariant numbers: every text the fault-free run's; any dtype: every stream continues
    exactly."""
    if texts_are_batch_invariant(dtype):
        assert_same_texts(result)
        return
    def last_chunk(r: dict) -> SimpleNamespace:     # what assert_held reads of a stream's last chunk
        return SimpleNamespace(finish_reason=r["finish_reason"],
                               usage=SimpleNamespace(completion_tokens=r["completion_tokens"]))
    for phase in ("during", "after"):
        assert_held(None, [(r["tokens"], r["text"], last_chunk(r)) for r in result[phase]], result["model"], dtype)


def test_packet_loss_on_every_hop(namespace, tmp_path):
    result = run_fault(namespace, "loss", tmp_path)
    assert_same_texts(result)
    assert result["workers_after_heal"] == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_partition_between_scheduler_and_worker_then_healed(namespace, tmp_path, dtype):
    result = run_fault(namespace, "partition", tmp_path, dtype)
    assert_streams_held(result, dtype)
    assert result["workers_while_cut"] == 1 and result["failovers"] > 0
    assert result["workers_after_heal"] == 2


def test_delay_and_jitter_between_scheduler_and_worker(namespace, tmp_path):
    result = run_fault(namespace, "delay", tmp_path)
    assert result["chunks_delayed"] > 0
    assert_same_texts(result)
    assert result["workers_after_heal"] == 2
