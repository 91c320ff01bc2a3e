"""One tokenizer thread per priority class, so that a long prompt is tokenized off the event loop
(which keeps taking in calls and streaming meanwhile) and a High prompt never queues behind a Low
one (the intake admits one request per class at a time).

Short prompts are tokenized on the event loop instead (SchedulerConfig.tokenize_inline_chars,
per class; default up to 8,192 characters for High, 512 for Medium and Low). The hop to a thread
and back costs ~130 us of CPU (a future, a wake-up of each side, each taking the GIL back), more
than encoding ~350 characters takes here (~75 us for 200); and while the loop is busy, each side
of the hop waits for the GIL, which the loop's thread gives up only every switch interval (5 ms).
Measured 2026-12-02 (a 150-character prompt, the loop kept busy by 4 tasks of 300 us slices):
the hop took p50 3.3 ms, p99 174 ms; tokenized on the loop, 1.4 / 1.6 ms (one round of those
tasks). So High's prompts, up to ~4 ms of encoding, never wait for the GIL; a flood's long Medium
and Low prompts go to their threads.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from services.common.priority import DEFAULT_PRIORITY, ORDER, Priority


class TokenizerThreads:
    """`executor(priority)`: that class's single tokenizer thread. One per class keeps a High
    prompt from queueing behind a Low one, as the intake admits one request per class at a time."""

    def __init__(self, inline_chars: list[int] = (0, 0, 0)):
        """`inline_chars`: per class (High, Medium, Low), the longest prompt (characters) tokenized
        on the caller's thread."""
        self._inline_chars = dict(zip(ORDER, inline_chars))
        self._executors: dict[Priority, ThreadPoolExecutor] = {
            p: ThreadPoolExecutor(1, thread_name_prefix=f"tokenizer-{p.label}") for p in ORDER}

    def inline(self, priority: int, chars: int) -> bool:
        """Whether a prompt of `chars` characters is tokenized on the event loop, not in a thread."""
        return chars <= self._inline_chars.get(priority, self._inline_chars[DEFAULT_PRIORITY])

    def executor(self, priority: int) -> ThreadPoolExecutor:
        """A value outside the classes (admission refuses it later) tokenizes as Medium."""
        return self._executors.get(priority, self._executors[DEFAULT_PRIORITY])

    def shutdown(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
