"""Each class's tokenizer thread, and which prompts are tokenized on the event loop instead."""
import threading

import pytest

from services.common.priority import HIGH, LOW, MEDIUM
from services.scheduler.tokenizer_threads import TokenizerThreads


def run_in(threads: TokenizerThreads, priority: int) -> str:
    """The name of the thread that tokenizes `priority`'s prompts."""
    return threads.executor(priority).submit(lambda: threading.current_thread().name).result(timeout=10)


def test_each_class_tokenizes_on_its_own_thread():
    threads = TokenizerThreads()
    try:
        names = {priority: run_in(threads, priority) for priority in (HIGH, MEDIUM, LOW)}
        assert names[HIGH].startswith("tokenizer-high") and names[LOW].startswith("tokenizer-low")
        assert len(set(names.values())) == 3
        # A priority outside the classes tokenizes as Medium (admission refuses it afterwards).
        assert run_in(threads, 99) == names[MEDIUM]
    finally:
        threads.shutdown()


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
