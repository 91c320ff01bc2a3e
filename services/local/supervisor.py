"""Keep a local cluster's processes running: restart what exits unexpectedly, with backoff.

`qos-serve up` and `make demo` run every service as a child process. Without supervision one
crashed worker used to stop the whole cluster; now the supervisor restarts it after a delay that
doubles with each crash in a row (1 s, 2 s, 4 s ... up to 30 s), while the others keep serving:
a restarted worker listens on its configured port again and its scheduler, which reconnects to
configured workers in the background, takes it back; a restarted scheduler is reconnected by the
router; in-flight work of a dead process is recomputed or migrated as before.

A process that crashes `crash_limit` times within `window_s` is not restarted again: it is left
stopped, with an error line, so that a broken config or a bad model does not restart forever
while the rest of the cluster serves what it can. Ctrl-C / SIGTERM stops everything as before.

The state of every process is written to a small JSON file (services/common/process_status.py): the router shows it on /metrics (`qos_process_restarts_total`, `qos_process_up`) and
in the console. On Kubernetes or compose the kubelet or the engine's restart policy does this job.
"""
from __future__ import annotations

import logging
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.common.process_status import RESTARTING, RUNNING, STOPPED, write_status

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 1.0        # after the first crash in a row
    max_delay_s: float = 30.0
    crash_limit: int = 5              # crashes within window_s before the process is left stopped
    window_s: float = 60.0

    def delay(self, crashes_in_a_row: int) -> float:
        return min(self.max_delay_s, self.first_delay_s * 2 ** max(0, crashes_in_a_row - 1))


@dataclass
class Supervised:
    name: str
    process: subprocess.Popen
    state: str = RUNNING
    restarts: int = 0
    last_exit_code: int | None = None
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float = 0.0
    crashes: deque = field(default_factory=deque)     # monotonic times of crashes within the window
    in_a_row: int = 0                                 # crashes without a healthy run between them

    def row(self) -> dict:
        return {"name": self.name, "pid": self.process.pid, "state": self.state, "restarts": self.restarts,
                "last_exit_code": self.last_exit_code}


class Supervisor:
    """Call check() now and then (the launcher's loop does, five times a second)."""

    def __init__(self, processes: dict[str, subprocess.Popen], relaunch: Callable[[str], subprocess.Popen],
                 policy: RestartPolicy = RestartPolicy(), status_file: Path | None = None,
                 say: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic):
        self.relaunch = relaunch          # name -> a new process for it (the same command)
        self.policy = policy
        self.status_file = status_file
        self.say = say                    # lines for the person watching `qos-serve up`
        self.clock = clock
        self.watched = {name: Supervised(name, process, started_at=clock()) for name, process in processes.items()}
        self.write_status()

    def check(self) -> None:
        now = self.clock()
        changed = False
        for entry in self.watched.values():
            if entry.state == RUNNING and entry.process.poll() is not None:
                self._exited(entry, now)
                changed = True
            elif entry.state == RESTARTING and now >= entry.restart_at:
                entry.process = self.relaunch(entry.name)
                entry.state, entry.started_at = RUNNING, now
                entry.restarts += 1
                self.say(f"supervisor: {entry.name} restarted (pid {entry.process.pid}, restart {entry.restarts})")
                changed = True
        if changed:
            self.write_status()

    def _exited(self, entry: Supervised, now: float) -> None:
        entry.last_exit_code = entry.process.returncode
        if now - entry.started_at >= self.policy.window_s:
            entry.in_a_row = 0                    # it ran well for a while: start the backoff over
        entry.in_a_row += 1
        entry.crashes.append(now)
        while entry.crashes and entry.crashes[0] < now - self.policy.window_s:
            entry.crashes.popleft()
        if len(entry.crashes) >= self.policy.crash_limit:
            entry.state = STOPPED
            message = (f"supervisor: {entry.name} exited with code {entry.last_exit_code}, its "
                       f"{len(entry.crashes)}th crash within {self.policy.window_s:g} s: NOT restarting it; "
                       f"the rest of the cluster keeps serving")
            log.error(message)
            self.say(message)
            return
        delay = self.policy.delay(entry.in_a_row)
        entry.state, entry.restart_at = RESTARTING, now + delay
        self.say(f"supervisor: {entry.name} exited with code {entry.last_exit_code}; restarting in {delay:g} s")

    def processes(self) -> dict[str, subprocess.Popen]:
        return {name: entry.process for name, entry in self.watched.items()}

    def write_status(self) -> None:
        if self.status_file is not None:
            write_status(self.status_file, [e.row() for e in self.watched.values()])
