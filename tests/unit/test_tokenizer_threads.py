"""Each class's tokenizer thread, and the CPU priority it runs at (Linux threads have their own)."""
import os
import sys
import threading

import pytest

from services.common.cpu_binding import MAX_NICE
from services.common.priority import HIGH, LOW, MEDIUM
from services.scheduler.tokenizer_threads import TokenizerThreads

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


@pytest.mark.parametrize("policy, inline_chars, expected", [
    # short Medium, Medium at its limit, long Medium, long High
    ("qos", [8192, 512, 512], ["loop", "loop", "tokenizer-medium", "loop"]),
    ("qos", [0, 0, 0], ["tokenizer-medium", "tokenizer-medium", "tokenizer-medium", "tokenizer-high"]),
    # priority-blind: Medium's length for every class (High's long prompt goes to a thread too)
    ("fcfs", [8192, 512, 512], ["loop", "loop", "tokenizer-medium", "tokenizer-high"]),
])
def test_short_prompts_are_tokenized_on_the_event_loop_and_long_ones_in_their_class_thread(policy, inline_chars,
                                                                                             expected):
    """The hop to a tokenizer thread costs more than encoding a short prompt, and waits for the GIL
    while the loop is busy (tokenizer_threads.py): up to its class's tokenize_inline_chars the
    loop's own thread tokenizes a prompt. Same token ids either way."""
    import asyncio

    from services.common.config import SchedulerConfig
    from services.common.proto.qos.v1 import common_pb2, scheduler_pb2
    from services.engine.default_model import default_model_dir
    from services.scheduler.admission import PoolLimits
    from services.scheduler.server import SchedulerService
    service = SchedulerService(SchedulerConfig(policy=policy, tokenize_inline_chars=inline_chars), "cpu",
                               str(default_model_dir()), [])
    service._limits = lambda: PoolLimits(max_context=8192, block_size=16, largest_worker_blocks=4096)
    tokenized_on = []
    tokenize = service._tokenize
    service._tokenize = lambda submit: tokenized_on.append(threading.current_thread().name) or tokenize(submit)
    short = "Tell me a joke about " + "cats " * 50                                     # 271 characters
    prompts = [(MEDIUM, short), (MEDIUM, short.ljust(512, "!")), (MEDIUM, short * 2), (HIGH, short * 2)]

    async def admit_each():
        loop_thread = threading.current_thread().name
        admitted = [await service.admit(scheduler_pb2.SubmitRequest(
            request_id=str(i), priority=priority, prompt=text, sampling=common_pb2.SamplingParams(max_tokens=4)))
            for i, (priority, text) in enumerate(prompts)]
        return loop_thread, admitted
    try:
        loop_thread, requests = asyncio.run(admit_each())
    finally:
        service.tokenizer_threads.shutdown()
    assert ["loop" if name == loop_thread else name.split("_")[0] for name in tokenized_on] == expected
    for request, (_, text) in zip(requests, prompts):
        assert request.prompt_ids == service.tokenizer.encode(text)
