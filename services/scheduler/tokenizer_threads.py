"""One tokenizer thread per priority class, so that a prompt is tokenized off the event loop
(which keeps taking in calls and streaming meanwhile) and a High prompt never queues behind a Low
one (the intake admits one request per class at a time).

High's prompts up to HIGH_INLINE_CHARS are tokenized on the event loop instead (`inline`): the hop
to a thread and back waits for the GIL while the loop is busy, and under a burst that wait was
most of a High request's time before its first step. In the paired burst comparison
(docs/performance.md) without this, the P99 time from a High request's arrival at the scheduler
to its first step was 31 ms against under 1 ms with it; encoding a chat-length prompt here takes
well under a millisecond."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from services.common.priority import DEFAULT_PRIORITY, HIGH, ORDER, Priority

HIGH_INLINE_CHARS = 8192        # ~2,000 tokens: a few ms of encoding at most


class TokenizerThreads:
    """`executor(priority)`: that class's single tokenizer thread."""

    def __init__(self) -> None:
        self._executors: dict[Priority, ThreadPoolExecutor] = {
            p: ThreadPoolExecutor(1, thread_name_prefix=f"tokenizer-{p.label}") for p in ORDER}

    @staticmethod
    def inline(priority: int, chars: int) -> bool:
        """Whether a prompt of `chars` characters is tokenized on the event loop, not in a thread."""
        return priority == HIGH and chars <= HIGH_INLINE_CHARS

    def executor(self, priority: int) -> ThreadPoolExecutor:
        """A value outside the classes (admission refuses it later) tokenizes as Medium."""
        return self._executors.get(priority, self._executors[DEFAULT_PRIORITY])

    def shutdown(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
