"""Run inside a network namespace by tests/e2e/test_network_faults.py (`ip netns exec NS python
tests/e2e/netns_driver.py FAULT OUT.json [DTYPE]`): a local cluster on the namespace's own
loopback (two workers, in DTYPE: fp32 by default; tests/e2e/test_failover.py's FAULT_MODELS says
which model each dtype runs), greedy streams once without a fault for reference, then again
under FAULT, applied with iptables in this namespace only; writes what the clients saw to OUT.json.

    loss        2% of every loopback packet dropped (iptables' statistic match), both ways
    partition   worker 0's port cut off in both directions mid-stream (no FIN, no RST: packets
                vanish), healed after the streams end; then worker 0 must be back in the pool
    delay       50 ms added each way between the scheduler and worker 0 (and jitter up to 20 ms),
                by bench/delay_proxy.py on that hop: this kernel has no sch_netem, so
                `tc netem delay` cannot be used
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.delay_proxy import ProxiedCluster  # noqa: E402
from services.local.cluster import LocalCluster  # noqa: E402
from services.tools.client import RouterClient  # noqa: E402
from tests.e2e.test_failover import fault_config, texts  # noqa: E402

LOSS = ["-m", "statistic", "--mode", "random", "--probability", "0.02", "-j", "DROP"]


def iptables(*args: str) -> None:
    subprocess.run(["iptables", *args], check=True)


async def under_fault(cluster: LocalCluster, fault: str, out: Path) -> None:
    port = cluster.config.pools[0].workers[0].port
    async with RouterClient(cluster.router_address) as client:
        reference = await texts(client, 8)
        if fault == "loss":
            iptables("-A", "INPUT", "-i", "lo", *LOSS)
            try:
                during = await texts(client, 8)
            finally:
                iptables("-F", "INPUT")
        elif fault == "delay":
            proxy = cluster.proxies[cluster.worker_name(cluster.config.pools[0].name, 0)]
            proxy.set(0.05, 0.02)
            try:
                during = await texts(client, 8)
            finally:
                proxy.set(0.0)
        else:
            async def cut():
                for flag in ("--dport", "--sport"):
                    iptables("-A", "INPUT", "-p", "tcp", flag, str(port), "-j", "DROP")
            try:
                during = await texts(client, 8, cut)
                stats_cut = await cluster.pool_stats()
            finally:
                iptables("-F", "INPUT")
        workers = 0
        for _ in range(600):          # healed: worker 0 reconnects
            workers = (await cluster.pool_stats()).workers
            if workers == 2:
                break
            await asyncio.sleep(0.1)
        after = await texts(client, 8)
    stats = await cluster.pool_stats()

    def dump(runs):
        return [{"tokens": list(tokens), "text": text, "finish_reason": last.finish_reason,
                 "completion_tokens": last.usage.completion_tokens} for tokens, text, last in runs]

    out.write_text(json.dumps({
        "fault": fault, "model": cluster.config.model, "reference": dump(reference), "during": dump(during), "after": dump(after),
        "workers_after_heal": workers, "failovers": stats.failovers,
        "workers_while_cut": stats_cut.workers if fault == "partition" else None,
        "chunks_delayed": sum(p.held for p in cluster.proxies.values()) if fault == "delay" else None}))


def main(fault: str, out: Path, dtype: str) -> None:
    config = fault_config(dtype, step_timeout_s=10.0)
    if fault == "delay":
        cluster = ProxiedCluster(config, [(config.pools[0].name, 0)], quiet=True)
    else:
        cluster = LocalCluster(config, quiet=True)
    with cluster:
        asyncio.run(under_fault(cluster, fault, out))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "fp32")
