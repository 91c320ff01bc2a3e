"""The faults bench/chaos.py injects into a local cluster, one at a time, in a fixed rotation:

    kill-worker      SIGKILL a worker; restarted `restart_after` seconds later
    kill-scheduler   SIGKILL a pool's scheduler; restarted likewise (its requests move pools)
    kill-router      SIGKILL one of the two routers; restarted likewise (its clients retry on the other)
    hang             SIGSTOP a worker for `hang_s` (longer than the step timeout), then SIGCONT
    loss             2% of every loopback packet dropped for `loss_s` (iptables' statistic match)
    partition        a worker's port cut off both ways for `partition_s` (packets vanish), then healed
    delay            50 ms (plus up to 20 ms jitter) each way between a scheduler and a worker for
                     `delay_s`, by the proxy in front of every worker (bench/delay_proxy.py)

loss and partition are iptables rules, so they run only inside a network namespace of the
benchmark's own (chaos.py makes one when it runs as root with iproute2 and iptables); elsewhere
they are left out and the JSON says why. Delay is a proxy, not `tc netem`: this machine's kernel
has no sch_netem.

Also here: resident memory of every service, sampled for the soak's growth figure.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

from bench.delay_proxy import ProxiedCluster

KINDS = ("kill-worker", "hang", "kill-router", "partition", "kill-scheduler", "delay", "loss")
NETWORK_KINDS = ("loss", "partition")
NETNS_ENV = "QOS_CHAOS_NETNS"          # set inside the namespace chaos.py re-runs itself in
LOSS = ["-m", "statistic", "--mode", "random", "--probability", "0.02", "-j", "DROP"]


def network_unavailable() -> str:
    """Why loss and partition cannot be injected here ('' when they can)."""
    if os.environ.get(NETNS_ENV):
        return ""
    if os.geteuid() != 0:
        return "network faults need root (a network namespace and iptables)"
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not installed (Debian's iproute2 / iptables)" if missing else ""


def make_namespace(name: str) -> str:
    """A fresh network namespace with its loopback up; '' or the reason it could not be made."""
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
    probe = subprocess.run(["ip", "netns", "exec", name, "iptables", "-L", "INPUT"], capture_output=True, text=True)
    if probe.returncode != 0:
        subprocess.run(["ip", "netns", "del", name])
        return f"iptables does not work in a namespace here: {probe.stderr.strip()}"
    return ""


def iptables(*args: str) -> None:
    subprocess.run(["iptables", *args], check=True)


@dataclass(slots=True)
class Injected:
    at: float                 # seconds since the load began
    kind: str
    target: str
    until: float = float("inf")      # when it was undone (restart, SIGCONT, rules flushed)

    def label(self) -> str:
        return f"{self.at:.0f}s {self.kind} {self.target}".rstrip()


@dataclass
class Faults:
    """Injects `kinds` in turn every `every` seconds, each undone after its duration."""
    cluster: ProxiedCluster
    kinds: list[str]
    every: float
    restart_after: float = 2.0
    hang_s: float = 8.0
    loss_s: float = 15.0
    partition_s: float = 10.0
    delay_s: float = 15.0
    log: list[Injected] = field(default_factory=list)
    failovers: int = 0            # from schedulers killed (their counters die with them)
    migrations: int = 0           # from routers killed

    def _target(self, kind: str) -> str:
        """The i-th fault of a kind takes pools, workers and routers in turn."""
        i = self.count(kind)
        pools = [p.name for p in self.cluster.config.pools]
        pool = pools[i % len(pools)]
        worker = self.cluster.worker_name(pool, (i // len(pools)) % 2)
        return {"kill-worker": worker, "hang": worker, "partition": worker, "delay": worker, "loss": "",
                "kill-scheduler": f"{pool}/scheduler",
                "kill-router": ["router", *(r.name for r in self.cluster.replicas)][i % 2]}[kind]

    async def run(self, start: float, first_at: float, until: float, counters) -> None:
        """`counters(name)` -> (failovers, migrations) a process has counted, read before it is killed."""
        n = 0
        while (at := first_at + self.every * n) < until:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            kind = self.kinds[n % len(self.kinds)]
            n += 1
            entry = Injected(time.monotonic() - start, kind, self._target(kind))
            self.log.append(entry)
            inject = {"kill": self._kill, "hang": self._hang, "loss": self._loss,
                      "partition": self._partition, "delay": self._delay}[kind.split("-")[0]]
            await inject(entry, counters)
            entry.until = time.monotonic() - start

    async def _kill(self, entry: Injected, counters) -> None:
        if "/worker-" not in entry.target:
            failovers, migrations = await counters(entry.target)
            self.failovers += failovers
            self.migrations += migrations
        process = self.cluster.processes[entry.target]
        process.send_signal(signal.SIGKILL)
        await asyncio.to_thread(process.wait)
        await asyncio.sleep(self.restart_after)
        self.cluster.relaunch(entry.target)

    async def _hang(self, entry: Injected, counters) -> None:
        process = self.cluster.processes[entry.target]
        process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(self.hang_s)
        finally:
            process.send_signal(signal.SIGCONT)

    async def _loss(self, entry: Injected, counters) -> None:
        iptables("-A", "INPUT", "-i", "lo", *LOSS)
        try:
            await asyncio.sleep(self.loss_s)
        finally:
            iptables("-F", "INPUT")

    async def _partition(self, entry: Injected, counters) -> None:
        pool, index = entry.target.split("/worker-")
        port = str(self.cluster.config.pool(pool).workers[int(index)].port)
        for flag in ("--dport", "--sport"):
            iptables("-A", "INPUT", "-p", "tcp", flag, port, "-j", "DROP")
        try:
            await asyncio.sleep(self.partition_s)
        finally:
            iptables("-F", "INPUT")

    async def _delay(self, entry: Injected, counters) -> None:
        proxy = self.cluster.proxies[entry.target]
        proxy.set(0.05, 0.02)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            proxy.set(0.0)

    def router_killed(self, name: str, since: float) -> bool:
        """Was router `name` killed, or still down, at some moment after `since` (load seconds)?"""
        return any(e.kind == "kill-router" and e.target == name and e.until >= since for e in self.log)

    def count(self, kind: str) -> int:
        return sum(1 for e in self.log if e.kind == kind)


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass
class MemoryWatch:
    """Resident memory of every service process, sampled every `every` seconds; a restarted
    process starts a new series (it is a new process)."""
    cluster: ProxiedCluster
    every: float = 10.0
    series: dict[tuple[str, int], list[tuple[float, int]]] = field(default_factory=dict)

    async def run(self, start: float) -> None:
        while True:
            for name, process in list(self.cluster.processes.items()):
                kib = rss_kib(process.pid) if process.poll() is None else None
                if kib is not None:
                    self.series.setdefault((name, process.pid), []).append((time.monotonic() - start, kib))
            await asyncio.sleep(self.every)

    def growth(self, after: float, span: float) -> dict[str, dict]:
        """Per process whose samples cover at least `span` seconds after `after` (the warm-up):
        the mean of its first three samples and of its last three (KiB), and the growth in %."""
        out = {}
        for (name, _), samples in self.series.items():
            kept = [(t, kib) for t, kib in samples if t >= after]
            if len(kept) < 6 or kept[-1][0] - kept[0][0] < span:
                continue
            first, last = sum(k for _, k in kept[:3]) / 3, sum(k for _, k in kept[-3:]) / 3
            out[name] = {"first_kib": round(first), "last_kib": round(last),
                         "growth_pct": round(100.0 * (last - first) / first, 2)}
        return out

    def labelled(self) -> dict[str, list[tuple[float, int]]]:
        """Every series by process name; a restarted process's later series as NAME (restart N)."""
        out, seen = {}, {}
        for (name, _), samples in self.series.items():
            seen[name] = seen.get(name, 0) + 1
            out[name if seen[name] == 1 else f"{name} (restart {seen[name] - 1})"] = \
                [(round(t, 1), kib) for t, kib in samples]
        return out


def plot_memory(path, series: dict[str, list[tuple[float, int]]], faults: list[Injected], warm_up_s: float,
                title: str) -> None:
    """Resident memory of every service over the run (PNG), faults marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (workers, others) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, samples in sorted(series.items()):
        axis = workers if "/worker-" in name else others
        axis.plot([t / 60 for t, _ in samples], [kib / 1024 for _, kib in samples], label=name, linewidth=1.2)
    for axis in (workers, others):
        axis.axvspan(0, warm_up_s / 60, color="grey", alpha=0.12)
        for fault in faults:
            axis.axvline(fault.at / 60, color="red", alpha=0.25, linewidth=0.8)
        axis.set_ylabel("resident memory (MiB)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, ncol=2)
    workers.set_title("workers (red lines: faults; grey: warm-up, not counted)", fontsize=9)
    others.set_title("routers and schedulers", fontsize=9)
    others.set_xlabel("minutes since the load began")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
