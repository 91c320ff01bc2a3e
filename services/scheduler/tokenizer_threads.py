"""One tokenizer thread per priority class, so that a prompt is tokenized off the event loop
(which keeps taking in calls and streaming meanwhile) and a High prompt never queues behind a Low
one (the intake admits one request per class at a time)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from services.common.priority import DEFAULT_PRIORITY, ORDER, Priority


class TokenizerThreads:
    """`executor(priority)`: that class's single tokenizer thread."""

    def __init__(self) -> None:
        self._executors: dict[Priority, ThreadPoolExecutor] = {
            p: ThreadPoolExecutor(1, thread_name_prefix=f"tokenizer-{p.label}") for p in ORDER}

    def executor(self, priority: int) -> ThreadPoolExecutor:
        """A value outside the classes (admission refuses it later) tokenizes as Medium."""
        return self._executors.get(priority, self._executors[DEFAULT_PRIORITY])

    def shutdown(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
