"""A local cluster's processes as the router shows them: on /metrics and in the console.

`qos-serve up` supervises its processes and writes their state to a file
(services/common/process_status.py) whose path it gives every service in PROCESSES_FILE_ENV. The
router reads that file when scraped and when the console draws; elsewhere (Kubernetes, compose,
a service started by hand) there is no file and nothing is shown: there the platform restarts
processes and reports it.
"""
from __future__ import annotations

import os

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.metrics import StateCollector
from services.common.process_status import PROCESSES_FILE_ENV, RUNNING, read_status


class ProcessView:
    def __init__(self, path: str | None, registry: CollectorRegistry | None = None):
        self.path = path
        if path and registry is not None:
            registry.register(StateCollector(self._families))

    @classmethod
    def from_env(cls, registry: CollectorRegistry | None = None) -> "ProcessView":
        return cls(os.environ.get(PROCESSES_FILE_ENV) or None, registry)

    def rows(self) -> list[dict]:
        return read_status(self.path) if self.path else []

    def _families(self):
        restarts = CounterMetricFamily("qos_process_restarts", "Restarts of a local cluster's process by its "
                                       "supervisor", labels=["process"])
        up = GaugeMetricFamily("qos_process_up", "1 while the supervisor sees the process running, 0 while it "
                               "waits to restart it or has given up on it", labels=["process"])
        for row in self.rows():
            restarts.add_metric([str(row.get("name"))], float(row.get("restarts", 0)))
            up.add_metric([str(row.get("name"))], 1.0 if row.get("state") == RUNNING else 0.0)
        yield restarts
        yield up
