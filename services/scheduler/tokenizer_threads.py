"""One tokenizer thread per priority class, the lower classes' at a lower CPU priority.

Why: a burst of long Low prompts is tokenized while the worker's engine computes and the event
loops stream. On a machine whose cores these share (a CPU pool, a small node), tokenizing a
flood's 4,000-token prompts took about a core for the flood's first second, and the engine
thread, computing High's cut-ins, got half a core (measured in bench/qos_burst.py with per-process
CPU sampling). The tokenizer releases the GIL, so the thread itself is what the kernel schedules:
a Medium or Low thread at a higher nice value runs on the CPU time the engine, the loops and
High's tokenizing leave. Nothing is slower while cores are free.

Thread niceness is per thread on Linux only (elsewhere every thread runs at the process's).

Short prompts are tokenized on the event loop instead (SchedulerConfig.tokenize_inline_chars,
per class; default up to 8,192 characters for High, 512 for Medium and Low). The hop to a thread
and back costs ~130 us of CPU (a future, a wake-up of each side, each taking the GIL back), more
than encoding ~350 characters takes here (~75 us for 200); and while the loop is busy, each side
of the hop waits for the GIL, which the loop's thread gives up only every switch interval (5 ms).
Measured 2026-12-02 (a 150-character prompt, the loop kept busy by 4 tasks of 300 us slices):
the hop took p50 3.3 ms, p99 174 ms; tokenized on the loop, 1.4 / 1.6 ms (one round of those
tasks). So High's prompts, up to ~4 ms of encoding, never wait for the GIL; a flood's long Medium
and Low prompts, which are what takes the CPU, still go to their niced threads.
"""
from __future__ import annotations

import logging
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from services.common.cpu_binding import raise_nice
from services.common.priority import DEFAULT_PRIORITY, ORDER, Priority

log = logging.getLogger(__name__)


def lower_this_thread(increment: int) -> int | None:
    """Raise the calling thread's nice value by `increment` (capped at MAX_NICE); returns the new value,
    or None where threads have no priority of their own. Raising it needs no privilege."""
    if increment <= 0:
        return None
    if not sys.platform.startswith("linux"):
        log.warning("tokenizer thread niceness needs Linux (threads have their own nice value only "
                    "there); %s runs at the process's priority", threading.current_thread().name)
        return None
    return raise_nice(threading.get_native_id(), increment)


class TokenizerThreads:
    """`executor(priority)`: that class's single tokenizer thread. One per class keeps a High
    prompt from queueing behind a Low one, as the intake admits one request per class at a time."""

    def __init__(self, nice_increments: list[int], inline_chars: list[int] = (0, 0, 0)):
        """`nice_increments`: High, Medium, Low, each added to the process's nice value (0: none);
        `inline_chars`: per class, the longest prompt (characters) tokenized on the caller's thread."""
        self._inline_chars = dict(zip(ORDER, inline_chars))
        self._executors: dict[Priority, ThreadPoolExecutor] = {
            p: ThreadPoolExecutor(1, thread_name_prefix=f"tokenizer-{p.label}",
                                  initializer=lower_this_thread, initargs=(increment,))
            for p, increment in zip(ORDER, nice_increments)}

    def inline(self, priority: int, chars: int) -> bool:
        """Whether a prompt of `chars` characters is tokenized on the event loop, not in a thread."""
        return chars <= self._inline_chars.get(priority, self._inline_chars[DEFAULT_PRIORITY])

    def executor(self, priority: int) -> ThreadPoolExecutor:
        """A value outside the classes (admission refuses it later) tokenizes as Medium."""
        return self._executors.get(priority, self._executors[DEFAULT_PRIORITY])

    def shutdown(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
