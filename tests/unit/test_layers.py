"""The layers stay apart (docs/architecture.md): each check imports modules in a fresh interpreter
and looks at what came in with them.

- the scheduler and router never import torch, nor the engine; the engine never imports them;
- pure scheduling and routing code does not import grpc: failures are ServiceErrors, mapped to
  gRPC statuses only at the servers' edge.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PURE = ["services.scheduler.batcher", "services.scheduler.request", "services.scheduler.planner",
        "services.scheduler.output", "services.scheduler.admission", "services.scheduler.policy",
        "services.router.routing", "services.router.validation", "services.common.errors",
        "services.common.drain", "services.common.wire", "services.common.kv_blocks",
        "services.router.sla", "services.router.alerts", "services.scheduler.autoscale",
        "services.router.latency_model", "services.router.slo_cost", "services.router.route_types",
        "services.scheduler.step_clock", "services.common.step_fit"]
SCHEDULER_AND_ROUTER = ["services.scheduler.server", "services.router.server"]
ENGINE = ["services.engine.engine", "services.engine.batch_runner", "services.worker.server"]


def loaded_with(module: str, prefixes: tuple[str, ...]) -> list[str]:
    """Modules whose name starts with one of `prefixes`, loaded by importing `module`."""
    code = (f"import sys, {module}; print('\\n'.join(m for m in sys.modules "
            f"if m.split('.')[0] in {prefixes!r} or m.startswith({prefixes!r})))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [m for m in result.stdout.split() if m]


@pytest.mark.parametrize("module", PURE)
def test_pure_scheduling_and_routing_code_imports_neither_grpc_nor_torch(module):
    assert loaded_with(module, ("grpc", "torch")) == []


@pytest.mark.parametrize("module", SCHEDULER_AND_ROUTER)
def test_scheduler_and_router_never_load_torch_or_the_engine(module):
    assert loaded_with(module, ("torch", "services.engine", "services.worker")) == []


@pytest.mark.parametrize("module", ENGINE)
def test_the_engine_and_worker_never_load_the_scheduler_or_router(module):
    assert loaded_with(module, ("services.scheduler", "services.router")) == []
