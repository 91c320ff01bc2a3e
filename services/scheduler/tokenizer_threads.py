"""One tokenizer thread per priority class, the lower classes' at a lower CPU priority.

Why: a burst of long Low prompts is tokenized while the worker's engine computes and the event
loops stream. On a machine whose cores these share (a CPU pool, a small node), tokenizing a
flood's 4,000-token prompts took about a core for the flood's first second, and the engine
thread, computing High's cut-ins, got half a core (measured in bench/qos_burst.py with per-process
CPU sampling). The tokenizer releases the GIL, so the thread itself is what the kernel schedules:
a Medium or Low thread at a higher nice value runs on the CPU time the engine, the loops and
High's tokenizing leave. Nothing is slower while cores are free.

Thread niceness is per thread on Linux only (elsewhere every thread runs at the process's).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from services.common.priority import DEFAULT_PRIORITY, ORDER, Priority

log = logging.getLogger(__name__)

MAX_NICE = 19                      # the lowest CPU priority Linux has


def lower_this_thread(increment: int) -> int | None:
    """Raise the calling thread's nice value by `increment` (capped at 19); returns the new value,
    or None where threads have no priority of their own. Raising it needs no privilege."""
    if increment <= 0:
        return None
    if not sys.platform.startswith("linux"):
        log.warning("tokenizer thread niceness needs Linux (threads have their own nice value only "
                    "there); %s runs at the process's priority", threading.current_thread().name)
        return None
    tid = threading.get_native_id()
    nice = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    os.setpriority(os.PRIO_PROCESS, tid, nice)
    return nice


class TokenizerThreads:
    """`executor(priority)`: that class's single tokenizer thread. One per class keeps a High
    prompt from queueing behind a Low one, as the intake admits one request per class at a time."""

    def __init__(self, nice_increments: list[int]):
        """`nice_increments`: High, Medium, Low, each added to the process's nice value (0: none)."""
        self._executors: dict[Priority, ThreadPoolExecutor] = {
            p: ThreadPoolExecutor(1, thread_name_prefix=f"tokenizer-{p.label}",
                                  initializer=lower_this_thread, initargs=(increment,))
            for p, increment in zip(ORDER, nice_increments)}

    def executor(self, priority: int) -> ThreadPoolExecutor:
        """A value outside the classes (admission refuses it later) tokenizes as Medium."""
        return self._executors.get(priority, self._executors[DEFAULT_PRIORITY])

    def shutdown(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
