"""Cores of their own for the engine: binding services to CPU cores.

On a CPU worker the engine's step is what High's first token waits for (a cut-in computes in the
step in flight), and on a machine the worker shares with its router, its scheduler and whatever
else runs there, the kernel spreads every busy thread over every core. Measured 2026-12-03 on this
project's 2-core machine (bench/flood_probe.py, the full-scale burst's flood, 4 runs each): the
worker's engine thread got 0.64 of a core while 800 requests arrived, and the flood's High
requests took 1.83x their idle TTFT at the median and 5.2x at the P90; with the worker bound to
core 1 and everything else to core 0 (the benchmark's client processes too, as clients on other
machines take none of the worker's) it got 0.84-0.89 of a core and they took 1.09-1.13x and
1.7-2.0x (with the clients left free on both cores, 1.89x and 3.35x: the binding only helps where
the worker's cores are left to it). vLLM's CPU backend does the same (its OpenMP threads bound to cores, others left to the
API server); on Kubernetes the kubelet's static CPU manager gives a Guaranteed pod whole cores.

Each service binds itself at start, before it starts any thread (threads inherit their creator's
cores), from its section's `cpu_cores` (empty: unbound). `cpu_binding = "auto"` (the default)
lets LocalCluster (`qos-serve up`, `make demo`, the benchmarks) fill those in when every service
runs on this machine and a core is left over for the control plane: `plan_cores` below.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.config import ClusterConfig, ConfigError


@dataclass(frozen=True, slots=True)
class CorePlan:
    workers: tuple[tuple[int, ...], ...]   # per worker, in the order given: its cores
    control: tuple[int, ...]               # the rest: router, scheduler (and a benchmark's clients)


def plan_cores(available: Sequence[int], threads: Sequence[int]) -> CorePlan | str:
    """Each worker `threads[i]` cores of its own, from the highest down; the control plane the
    cores left (the lowest, where the kernel tends to run its own work too). Returns the reason
    instead when no core would be left for the control plane: then nothing is bound, since a
    control plane squeezed onto a worker's cores is slower than the kernel's own spreading."""
    cores = sorted(available)
    wanted = sum(threads)
    if wanted >= len(cores):
        return (f"the workers' {wanted} thread(s) leave no core of the {len(cores)} available for "
                "the router and scheduler")
    workers, end = [], len(cores)
    for count in threads:
        workers.append(tuple(cores[end - count:end]))
        end -= count
    return CorePlan(tuple(workers), tuple(cores[:end]))


def bind_cluster(config: ClusterConfig, scalable: bool) -> tuple[tuple[int, ...], str]:
    """LocalCluster's "auto" binding: sets every worker's, scheduler's and the router's
    `cpu_cores` in `config` (all of them run on this machine). Returns (the control plane's
    cores, where clients on this machine should run too; () when nothing was bound) and a line
    saying what was done or why not. Nothing is bound when the config binds any service itself,
    or with workers added at run time (`scalable`: they would have no cores of their own)."""
    services = [config.router] + [s for p in config.pools for s in (p.scheduler, *p.workers)]
    if config.cpu_binding == "off":
        return (), "CPU binding off (cpu_binding = \"off\")"
    if any(s.cpu_cores for s in services):
        return (), "CPU cores as the config sets them (cpu_cores)"
    if scalable:
        return (), "CPU binding off: autoscaled workers would have no cores of their own"
    workers = [w for p in config.pools for w in p.workers]
    plan = plan_cores(available_cores(), [max(1, w.threads) for w in workers])
    if isinstance(plan, str):
        return (), f"CPU binding off: {plan}"
    for worker, cores in zip(workers, plan.workers):
        worker.cpu_cores = list(cores)
    for service in [config.router] + [p.scheduler for p in config.pools]:
        service.cpu_cores = list(plan.control)
    by_worker = "; ".join(f"{_cores(c)}" for c in plan.workers)
    return plan.control, f"CPU cores: worker(s) {by_worker}; router and scheduler(s) {_cores(plan.control)}"


def available_cores() -> list[int]:
    """The cores this process may run on (all of the machine's, unless it was started bound)."""
    if not hasattr(os, "sched_getaffinity"):
        return list(range(os.cpu_count() or 1))
    return sorted(os.sched_getaffinity(0))


def bind_process(cores: Sequence[int], where: str) -> None:
    """Run this process, every thread it has and every thread it will start, on `cores` only;
    nothing when `cores` is empty. `where` names the config key in errors."""
    if not cores:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(f"{where}: binding to CPU cores needs Linux (sched_setaffinity); remove it here")
    available = available_cores()
    missing = sorted(set(cores) - set(available))
    if missing:
        raise ConfigError(f"{where} = {list(cores)}: core(s) {missing} are not available to this process "
                          f"(available: {_cores(available)})")
    tasks = Path("/proc/self/task")
    threads = [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [0]
    for thread in threads:       # sched_setaffinity binds one thread; new threads inherit it
        try:
            os.sched_setaffinity(thread, cores)
        except ProcessLookupError:      # a thread that ended meanwhile
            pass


def bound_cores(pid: int | str = "self") -> list[int]:
    """The cores a process's main thread may run on, as /proc says (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_core_list(line.split(":", 1)[1])
    raise ValueError(f"/proc/{pid}/status has no Cpus_allowed_list")


def parse_core_list(text: str) -> list[int]:
    """"0-2,5" -> [0, 1, 2, 5] (the kernel's list format)."""
    cores = []
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cores += range(int(low), int(high or low) + 1)
    return cores


def _cores(cores: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, cores)) + "]"
