"""The layers stay apart (docs/architecture.md).

Statically, from every `import` in services/ (at module level, in functions and under
TYPE_CHECKING alike):
- no import cycle between modules;
- each package imports only the packages below it (LAYERS): the router reaches the scheduler over
  gRPC, never by import; the control plane never imports the router.

At run time, importing modules in a fresh interpreter and looking at what came in with them:
- the scheduler and router never import torch, nor the engine; the engine never imports them;
- pure scheduling and routing code does not import grpc: failures are ServiceErrors, mapped to
  gRPC statuses only at the servers' edge.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What each package of services/ may import, besides itself. Generated code (common/proto) is
# common's. A package missing here fails the test: a new package says where it sits.
LAYERS = {
    "common": set(),
    "store": {"common"},
    "engine": {"common"},
    "worker": {"common", "engine"},
    "scheduler": {"common"},
    "control": {"common", "store"},
    "router": {"common", "control", "store"},
    "local": {"common", "engine"},
    "tools": {"common", "store", "engine", "worker", "scheduler", "control", "router", "local"},
    "cpu_worker": {"common", "tools"},
    "gpu_worker": {"common", "tools"},
    "npu_worker": {"common", "tools"},
}


def service_modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / "services").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "proto" in parts:
            continue
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """module -> the services modules it imports (a name that is not a module counts as its package)."""
    modules = service_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in service_modules()} - {""}
    assert packages <= LAYERS.keys(), f"say where {sorted(packages - LAYERS.keys())} sit in LAYERS"


def test_imports_run_down_the_layers_only():
    wrong = sorted(f"{module} imports {target}" for module, targets in import_graph().items()
                   for target in targets
                   if package_of(target) not in LAYERS.get(package_of(module), set()) | {package_of(module), ""})
    assert wrong == []

PURE = ["services.scheduler.batcher", "services.scheduler.request", "services.scheduler.planner",
        "services.scheduler.output", "services.scheduler.admission", "services.scheduler.policy",
        "services.router.routing", "services.router.validation", "services.common.errors",
        "services.common.drain", "services.common.wire", "services.common.kv_blocks",
        "services.control.sla", "services.control.alerts", "services.scheduler.autoscale",
        "services.router.latency_model", "services.router.slo_cost", "services.router.route_types",
        "services.common.step_fit"]
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


MAX_MODULE_LINES = 350      # non-blank: a module is one job a reader can hold in mind


def test_no_module_is_longer_than_a_reader_can_hold():
    lengths = {name: sum(1 for line in path.read_text().splitlines() if line.strip())
               for name, path in service_modules().items()}
    assert {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES} == {}
