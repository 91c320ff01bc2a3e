"""Virtual time: an asyncio event loop whose clock jumps to its next timer when nothing is ready
(no real sleeping, no I/O), and the scheduler modules' `time` pointed at that clock.

The event loop's own clock drives asyncio.sleep, wait_for and asyncio.timeout (the step timeout,
the link's 5 s connect timeouts, the idle wait). The scheduler also reads time.perf_counter and
time.monotonic directly (heartbeats, the orphan grace, hold-offs, the membership's forgetting,
stream holding): `virtual_time` replaces the `time` name in those modules (PATCHED) with an object
whose clocks read the loop's, for the length of a run, and puts the real module back after.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import selectors
import time as real_time
from collections.abc import Callable

# Every services module whose code reads time.* while a pool runs (grep "time\." services/scheduler).
PATCHED = ("services.scheduler.batcher", "services.scheduler.failover", "services.scheduler.membership",
           "services.scheduler.monitor", "services.scheduler.planner", "services.scheduler.stream_out",
           "services.scheduler.worker_link", "services.scheduler.output")

EPOCH = 1_700_000_000.0     # what time.time() reads at virtual 0


class Stuck(RuntimeError):
    """Nothing ready and no timer: every task waits for something that will never come."""


class _NoIO(selectors.BaseSelector):
    """The loop's selector: there is never I/O, so select() only moves the clock on."""

    def __init__(self, loop: VirtualLoop):
        self._loop = loop

    def select(self, timeout=None):
        if timeout is None:
            raise Stuck("no task is ready and no timer is set")
        if timeout > 0:
            self._loop.now += timeout
        return []

    def register(self, fileobj, events, data=None):
        raise RuntimeError("no I/O in the simulator")

    def unregister(self, fileobj):
        raise RuntimeError("no I/O in the simulator")

    def get_map(self):
        return {}

    def close(self):
        pass


class VirtualLoop(asyncio.BaseEventLoop):
    """An event loop on virtual time. `after_each` runs after every iteration (the invariants)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self._selector = _NoIO(self)
        self._clock_resolution = 1e-7
        self.after_each: Callable[[], None] | None = None
        self.iterations = 0

    def time(self) -> float:
        return self.now

    def _process_events(self, event_list) -> None:
        pass

    def _write_to_self(self) -> None:
        pass

    def _run_once(self) -> None:
        super()._run_once()
        self.iterations += 1
        if self.after_each is not None:
            self.after_each()


class _VirtualTimeModule:
    """`time` as the patched modules see it: the loop's clock, everything else the real module's."""

    def __init__(self, loop: VirtualLoop):
        self._loop = loop

    def perf_counter(self) -> float:
        return self._loop.now

    monotonic = perf_counter

    def time(self) -> float:
        return EPOCH + self._loop.now

    def time_ns(self) -> int:
        return int((EPOCH + self._loop.now) * 1e9)

    def __getattr__(self, name):
        return getattr(real_time, name)


@contextlib.contextmanager
def virtual_time(loop: VirtualLoop):
    modules = [importlib.import_module(name) for name in PATCHED]
    saved = [(m, m.__dict__.get("time")) for m in modules if "time" in m.__dict__]
    shim = _VirtualTimeModule(loop)
    for module, _ in saved:
        module.time = shim
    try:
        yield
    finally:
        for module, original in saved:
            module.time = original
