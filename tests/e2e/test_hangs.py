"""A worker that hangs (SIGSTOP) mid-stream: within the step timeout its sequences are recomputed
on the other worker, continuing from exactly the tokens their clients hold (in fp32: the text
they would have had); when it wakes (SIGCONT) its old stream is gone, so nothing it computed
meanwhile reaches a client; it rejoins clean and serves again."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.local.cluster import LocalCluster
from services.tools.client import RouterClient
from tests.e2e.conftest import run
from tests.e2e.test_failover import DTYPES, assert_held, fault_config, texts

pytestmark = pytest.mark.slow

STEP_TIMEOUT_S = 2.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_hung_worker_is_detected_fenced_and_rejoins_clean(dtype):
    config = fault_config(dtype, step_timeout_s=STEP_TIMEOUT_S)
    with LocalCluster(config, quiet=True) as cluster:
        pid = cluster.processes["cpu/worker-0"].pid
        try:
            async def go():
                async with RouterClient(cluster.router_address) as client:
                    reference = await texts(client, 8)

                    async def hang():
                        os.kill(pid, signal.SIGSTOP)

                    during = await texts(client, 8, hang)
                    stats = await cluster.pool_stats()
                    os.kill(pid, signal.SIGCONT)
                    while (await cluster.pool_stats()).workers < 2:
                        await asyncio.sleep(0.1)
                    after = await texts(client, 8)
                    return reference, during, after, stats

            reference, during, after, stats = run(go())
        finally:
            os.kill(pid, signal.SIGCONT)
        assert_held(reference, during, cluster.config.model, dtype)   # no lost, repeated or interleaved token
        assert_held(reference, after, cluster.config.model, dtype)
        assert stats.workers == 1 and stats.failovers > 0
