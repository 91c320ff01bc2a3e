"""Each class's tokenizer thread, and the CPU priority it runs at (Linux threads have their own)."""
import os
import sys
import threading

import pytest

from services.common.priority import HIGH, LOW, MEDIUM
from services.scheduler.tokenizer_threads import MAX_NICE, TokenizerThreads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="only Linux gives a thread a nice value of its own")


def thread_nice() -> tuple[str, int]:
    return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def run_in(threads: TokenizerThreads, priority: int) -> tuple[str, int]:
    return threads.executor(priority).submit(thread_nice).result(timeout=10)


def test_each_class_tokenizes_on_its_own_thread_at_its_nice_value():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    threads = TokenizerThreads([0, 5, 10])
    try:
        names = {}
        for priority, increment in ((HIGH, 0), (MEDIUM, 5), (LOW, 10)):
            names[priority], nice = run_in(threads, priority)
            assert nice == min(MAX_NICE, base + increment)
        assert names[HIGH].startswith("tokenizer-high") and names[LOW].startswith("tokenizer-low")
        assert len(set(names.values())) == 3
        # The process (and so the engine, the event loop, High's thread) keeps its own priority.
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
        # A priority outside the classes tokenizes as Medium (admission refuses it afterwards).
        assert run_in(threads, 99)[0] == names[MEDIUM]
    finally:
        threads.shutdown()


def test_the_nice_value_stops_at_the_lowest_priority():
    threads = TokenizerThreads([0, 0, MAX_NICE])
    try:
        assert run_in(threads, LOW)[1] == MAX_NICE
        assert run_in(threads, MEDIUM)[1] == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        threads.shutdown()


@pytest.mark.parametrize("policy, low_increment", [("qos", 10), ("fcfs", 0)])
def test_the_fcfs_baseline_tokenizes_every_class_at_the_same_priority(policy, low_increment):
    from services.common.config import SchedulerConfig
    from services.engine.default_model import default_model_dir
    from services.scheduler.server import SchedulerService
    service = SchedulerService(SchedulerConfig(policy=policy, tokenizer_nice=[0, 5, 10]), "cpu",
                               str(default_model_dir()), [])
    try:
        assert run_in(service.tokenizer_threads, LOW)[1] == min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, 0)
                                                                + low_increment)
    finally:
        service.tokenizer_threads.shutdown()
