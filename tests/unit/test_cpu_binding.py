"""CPU binding (services/common/cpu_binding.py): the plan, the config keys, binding a live process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from services.common.config import ConfigError, WorkerConfig, single_pool
from services.common.config_file import parse_config
from services.common import cpu_binding
from services.common.cpu_binding import CorePlan, bind_cluster, parse_core_list, plan_cores

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's (sched_setaffinity)")


def test_workers_take_the_highest_cores_and_the_control_plane_keeps_the_rest():
    assert plan_cores(range(8), [2, 2, 1]) == CorePlan(workers=((6, 7), (4, 5), (3,)), control=(0, 1, 2))
    assert plan_cores([5, 2, 9, 7], [1]) == CorePlan(workers=((9,),), control=(2, 5, 7))  # not 0..n-1
    assert plan_cores([0, 1], [1], min_control=1) == CorePlan(workers=((1,),), control=(0,))


def test_no_plan_where_the_workers_would_leave_the_control_plane_too_few_cores():
    # By default two cores for router, scheduler and local clients: one saturated in a burst.
    assert plan_cores([0, 1], [1]) == "the workers' 1 thread(s) leave 1 of the 2 cores for the router and " \
                                      "scheduler, fewer than 2"
    assert isinstance(plan_cores([0, 1, 2], [2]), str)
    assert isinstance(plan_cores([0, 1], [1, 1], min_control=1), str)


def _one_worker(threads: int = 1):
    return single_pool(workers=[WorkerConfig(threads=threads)])


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(cpu_binding, "available_cores", lambda: [0, 1, 2, 3])


def test_auto_binding_fills_in_every_service_and_says_what_it_did(four_cores):
    config = _one_worker(threads=2)
    control, line = bind_cluster(config, scalable=False)
    assert config.pools[0].workers[0].cpu_cores == [2, 3]
    assert config.router.cpu_cores == config.pools[0].scheduler.cpu_cores == [0, 1] == list(control)
    assert line == "CPU cores: worker(s) [2, 3]; router and scheduler(s) [0, 1]"


def test_on_two_cores_auto_binds_nothing(monkeypatch):
    monkeypatch.setattr(cpu_binding, "available_cores", lambda: [0, 1])
    config = _one_worker()
    assert bind_cluster(config, scalable=False) == ((), "CPU binding off: the workers' 1 thread(s) leave 1 of the "
                                                         "2 cores for the router and scheduler, fewer than 2")
    assert config.pools[0].workers[0].cpu_cores == config.router.cpu_cores == []


@pytest.mark.parametrize("setup, reason", [
    (lambda c: setattr(c, "cpu_binding", "off"), 'cpu_binding = "off"'),
    (lambda c: setattr(c.router, "cpu_cores", [0]), "as the config sets them"),
    (lambda c: None, "autoscaled workers"),
])
def test_auto_binding_stands_aside(four_cores, setup, reason):
    config = _one_worker()
    setup(config)
    before = [config.router.cpu_cores[:], config.pools[0].workers[0].cpu_cores[:]]
    control, line = bind_cluster(config, scalable=reason == "autoscaled workers")
    assert control == () and reason in line
    assert [config.router.cpu_cores, config.pools[0].workers[0].cpu_cores] == before


def test_local_clients_keep_off_the_cores_a_config_gives_its_workers(four_cores):
    config = _one_worker()
    config.pools[0].workers[0].cpu_cores = [3]
    assert bind_cluster(config, scalable=False) == ((0, 1, 2), "CPU cores as the config sets them (cpu_cores)")


@pytest.mark.parametrize("cores", [[-1], [0, 0], [True], ["1"], 3])
def test_bad_cpu_cores_are_refused_naming_the_key(cores):
    with pytest.raises(ConfigError, match=r"workers?.*cpu_cores|cpu_cores"):
        parse_config({"workers": [{"cpu_cores": cores}]})


def test_cpu_binding_takes_auto_or_off():
    assert parse_config({}).cpu_binding == "auto"
    assert parse_config({"cpu_binding": "off", "router": {"cpu_cores": [0]}}).router.cpu_cores == [0]
    with pytest.raises(ConfigError, match="cpu_binding must be one of auto, off"):
        parse_config({"cpu_binding": "on"})


def test_the_kernels_core_lists_parse():
    assert parse_core_list("0-2,5\n") == [0, 1, 2, 5]
    assert parse_core_list("3") == [3]


BIND_IN_A_PROCESS = textwrap.dedent("""
    import os, sys, threading, time
    from services.common.config import ConfigError
    from services.common.cpu_binding import bind_process, bound_cores
    core = min(os.sched_getaffinity(0))
    started = threading.Event()
    def wait():
        started.set()
        time.sleep(5)
    threading.Thread(target=wait, daemon=True).start()     # a thread that exists before the binding
    started.wait()
    try:
        bind_process([4095], "worker.cpu_cores")
    except ConfigError as exc:
        print("refused:", exc)
    bind_process([core], "worker.cpu_cores")
    late = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    late.start()
    threads = {int(t): bound_cores(f"self/task/{t}") for t in os.listdir("/proc/self/task")}
    print("core", core, "threads", len(threads), "all bound", all(c == [core] for c in threads.values()))
""")


@linux_only
def test_binding_a_process_binds_the_threads_it_has_and_those_it_starts():
    out = subprocess.run([sys.executable, "-c", BIND_IN_A_PROCESS], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    assert "refused: worker.cpu_cores = [4095]: core(s) [4095] are not available to this process" in out.stdout
    assert "threads 3 all bound True" in out.stdout, out.stdout
