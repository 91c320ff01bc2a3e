"""Graceful drain: what every service does between SIGTERM and exit.

    1. health reports NOT_SERVING at once (load balancers, Kubernetes, our router stop sending);
    2. new requests are refused with UNAVAILABLE saying the service drains, and when to retry;
    3. requests in flight go on until they finish, for at most `drain_seconds`;
    4. only then are the service's own tasks and channels cleaned up, and the process exits 0.

This object is the shared state: handlers wrap a request's lifetime in `track()` (or `enter()`
and `leave()`), which refuses it while draining; the server loop (services/common/grpc_server.py) calls `begin()` and then
waits in `wait_idle()`. Pure asyncio, no grpc.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from services.common.errors import ServiceError, unavailable

log = logging.getLogger(__name__)

DEFAULT_DRAIN_SECONDS = 30.0
# What a refused client is told: by then another replica has usually taken over (or this one has
# been replaced), so a short wait is enough.
RETRY_AFTER_DRAIN_MS = 1000


class Drain:
    def __init__(self, service: str, seconds: float = DEFAULT_DRAIN_SECONDS):
        self.service = service          # "router", "scheduler of pool cpu", "worker 127.0.0.1:50053"
        self.seconds = seconds
        self.requested = asyncio.Event()  # SIGTERM, SIGINT or a Drain RPC: run_server begins the drain
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def request(self) -> None:
        """Ask the server loop to drain and stop (what SIGTERM does)."""
        self.requested.set()

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            log.info("%s draining: %d request(s) in flight, up to %.0f s", self.service,
                     self._in_flight, self.seconds)

    def refusal(self) -> ServiceError:
        return unavailable(f"{self.service} is draining (shutting down) and takes no new requests; "
                           "retry shortly (another replica, or this one once restarted)",
                           retry_after_ms=RETRY_AFTER_DRAIN_MS, reason="draining")

    def check(self) -> None:
        """Raise the drain's UNAVAILABLE refusal if draining."""
        if self.draining:
            raise self.refusal()

    def enter(self) -> None:
        """A request starts: refused if draining, else counted as in flight until leave()."""
        self.check()
        self._in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    @contextlib.contextmanager
    def track(self):
        """enter() ... leave() around a block."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    async def wait_idle(self) -> bool:
        """Wait until nothing is in flight or the drain time is up; True if everything finished."""
        try:
            await asyncio.wait_for(self._idle.wait(), self.seconds)
            return True
        except asyncio.TimeoutError:
            log.warning("%s: drain time of %.0f s is up with %d request(s) still in flight",
                        self.service, self.seconds, self._in_flight)
            return False
