"""Cores of their own for the engine: binding services to CPU cores (and a nice value each).

On a CPU worker the engine's step is what High's first token waits for (a cut-in computes in the
step in flight), and on a machine the worker shares with its router, its scheduler and whatever
else runs there, the kernel spreads every busy thread over every core: during a burst's flood on
this project's 2-core machine the worker's engine thread got 0.6-0.7 of a core. vLLM's CPU backend
binds its OpenMP threads to cores and leaves others to its API server; on Kubernetes the
kubelet's static CPU manager gives a Guaranteed pod whole cores.

Each service binds itself at start, before it starts any thread (threads inherit their creator's
cores), from its section's `cpu_cores` (empty: unbound). `cpu_binding = "auto"` (the default)
lets a local cluster (`qos-serve up`, `make demo`, the benchmarks) fill those in when every
service runs on this machine and the workers leave MIN_CONTROL_CORES to the control plane.

What it did on 2 cores (2026-12-03; docs/performance.md, "Cores of their own"): the worker on core
1, everything else (the benchmark's clients too) on core 0. The worker's engine thread got
0.84-0.89 of a core in the flood, and bench/flood_probe.py's flood High requests took 1.38x their
idle TTFT at the median against 2.01x unbound; but core 0 saturated, the load generator sent the
flood late (median 185-361 ms against 67-115 ms) and the full-scale burst's High P99 was 3.1-3.3x
idle against 4.05x unbound, with its High requests waiting up to 74 ms outside the scheduler. So
"auto" leaves a 2-core machine unbound; `bench/qos_burst.py` variant `qos-bound` binds it as above.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.config import ClusterConfig, ConfigError

# "auto" binds only where the workers leave this many cores to the rest: with one, the router, the
# scheduler and the clients on it saturated it during a burst's flood (2026-12-03, full scale: the
# load generator sent its requests a median 270 ms late, and High's time outside the scheduler
# reached 74 ms), which no longer shows a gain over leaving placement to the kernel.
MIN_CONTROL_CORES = 2


@dataclass(frozen=True, slots=True)
class CorePlan:
    workers: tuple[tuple[int, ...], ...]   # per worker, in the order given: its cores
    control: tuple[int, ...]               # the rest: router, scheduler (and a benchmark's clients)


def plan_cores(available: Sequence[int], threads: Sequence[int],
               min_control: int = MIN_CONTROL_CORES) -> CorePlan | str:
    """Each worker `threads[i]` cores of its own, from the highest down; the control plane the
    cores left (the lowest, where the kernel tends to run its own work too). Returns the reason
    instead when fewer than `min_control` cores would be left: then nothing is bound."""
    cores = sorted(available)
    wanted = sum(threads)
    if len(cores) - wanted < max(1, min_control):
        return (f"the workers' {wanted} thread(s) leave {max(0, len(cores) - wanted)} of the {len(cores)} "
                f"cores for the router and scheduler, fewer than {max(1, min_control)}")
    workers, end = [], len(cores)
    for count in threads:
        workers.append(tuple(cores[end - count:end]))
        end -= count
    return CorePlan(tuple(workers), tuple(cores[:end]))


def apply_plan(config: ClusterConfig, plan: CorePlan) -> None:
    """Set every worker's cpu_cores (in pool order), and the router's and schedulers' to the rest."""
    workers = [w for p in config.pools for w in p.workers]
    for worker, cores in zip(workers, plan.workers):
        worker.cpu_cores = list(cores)
    for service in [config.router] + [p.scheduler for p in config.pools]:
        service.cpu_cores = list(plan.control)


def worker_threads(config: ClusterConfig) -> list[int]:
    return [max(1, w.threads) for p in config.pools for w in p.workers]


def bind_cluster(config: ClusterConfig, scalable: bool) -> tuple[tuple[int, ...], str]:
    """A local cluster's binding (all its services run on this machine): under "auto", fills in
    every service's `cpu_cores` in `config` where no service sets them itself, no workers are
    added at run time (`scalable`: they would have no cores of their own) and the workers leave
    MIN_CONTROL_CORES. Returns the cores clients on this machine should run on (those of no
    worker, when some worker is bound; else ()) and a line saying what was done or why not."""
    services = [config.router] + [s for p in config.pools for s in (p.scheduler, *p.workers)]
    if any(s.cpu_cores for s in services):
        line = "CPU cores as the config sets them (cpu_cores)"
    elif config.cpu_binding == "off":
        return (), "CPU binding off (cpu_binding = \"off\")"
    elif scalable:
        return (), "CPU binding off: autoscaled workers would have no cores of their own"
    else:
        plan = plan_cores(available_cores(), worker_threads(config))
        if isinstance(plan, str):
            return (), f"CPU binding off: {plan}"
        apply_plan(config, plan)
        line = (f"CPU cores: worker(s) {'; '.join(map(_cores, plan.workers))}; router and scheduler(s) "
                f"{_cores(plan.control)}")
    taken = {c for p in config.pools for w in p.workers for c in w.cpu_cores}
    return (tuple(c for c in available_cores() if c not in taken) if taken else ()), line


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
    for thread in _threads():       # sched_setaffinity binds one thread; new threads inherit it
        try:
            os.sched_setaffinity(thread, cores)
        except ProcessLookupError:      # a thread that ended meanwhile
            pass


def _threads() -> list[int]:
    """This process's thread ids (Linux), else [0]: the calling thread."""
    tasks = Path("/proc/self/task")
    return [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [0]


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
