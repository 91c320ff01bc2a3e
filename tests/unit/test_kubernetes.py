"""The Kubernetes manifests (deploy/kubernetes): every overlay renders with `kubectl kustomize`,
its objects validate against the Kubernetes API schemas (`kubernetes-validate`, strict), the CRDs
it uses (KEDA's ScaledObject, Prometheus Operator's PrometheusRule; their schemas are not bundled)
have the fields they need, and everything agrees with the cluster config the overlay carries in
its ConfigMap: ports, the Services the scheduler resolves, probe ports, drain time < grace period,
worker threads <= CPU limit, the metrics KEDA scales on = ones the scheduler exports."""
from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from services.common.config_file import parse_config
from services.common.grpc_server import LIVENESS_SERVICE
from services.control.alert_rules import rules

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ["cpu", "gpu", "npu", "autoscale"]
KUBERNETES_VERSION = "1.32"          # the API the manifests are written for (kubectl 1.32 here)
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (it renders the kustomizations)")
IMAGES = {"cpu": "qos-serve:cpu", "cuda": "qos-serve:gpu", "npu": "qos-serve:npu"}


def render(overlay: str) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(ROOT / "deploy" / "kubernetes" / "overlays" / overlay)],
                         capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def config_of(objects: list[dict]):
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("qos-cluster")]
    return parse_config(tomllib.loads(config_map["data"]["cluster.toml"])), config_map["metadata"]["name"]


def cpu_cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request):
    return request.param, render(request.param)


def test_every_object_validates_against_the_kubernetes_schemas(rendered):
    import kubernetes_validate
    overlay, objects = rendered
    crds = []
    for obj in objects:
        if obj["apiVersion"].startswith(("keda.sh/", "monitoring.coreos.com/")):
            crds.append(obj)
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    assert {o["kind"] for o in crds} <= {"ScaledObject", "PrometheusRule"}


def test_the_crds_carry_what_they_need(rendered):
    overlay, objects = rendered
    config, _ = config_of(objects)
    rule = find(objects, "PrometheusRule", "qos-serve-sla")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["spec"] == rules(config)
    scaled = [o for o in objects if o["kind"] == "ScaledObject"]
    assert bool(scaled) == (overlay == "autoscale")
    for obj in scaled:
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        target = find(objects, "Deployment", obj["spec"]["scaleTargetRef"]["name"])
        pool = config.pool(target["metadata"]["labels"]["qos-serve/pool"])
        assert (obj["spec"]["minReplicaCount"], obj["spec"]["maxReplicaCount"]) == pool.worker_limits()
        desired, waiting = obj["spec"]["triggers"]
        for trigger in (desired, waiting):
            assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
            assert trigger["metadata"]["serverAddress"].startswith("http")
        assert desired["metadata"]["query"] == f'max(qos_desired_workers{{pool="{pool.name}"}})'
        assert desired["metadata"]["threshold"] == "1"
        # vLLM's queue gauge: a worker per full batch waiting.
        assert waiting["metadata"]["query"] == f'sum(vllm:num_requests_waiting{{pool="{pool.name}"}})'
        assert waiting["metadata"]["threshold"] == str(pool.scheduler.max_running)


def test_the_scheduler_exports_the_metrics_keda_scales_on():
    from services.common.config import AutoscaleConfig
    from services.scheduler.autoscale import ScaleAdvisor
    from services.scheduler.stats import scale_metrics
    from services.scheduler.vllm_metrics import vllm_gauges

    class Policy:
        def waiting(self, priority):
            return 0

    class Batcher:
        policy = Policy()
        links, running = [], {}
        prefix_cache, prompt_tokens, output_tokens, preemptions = None, {}, {}, 0

    families = {f.name: f for f in scale_metrics("cpu", Batcher(), ScaleAdvisor(AutoscaleConfig(), 1, 4))}
    desired = families["qos_desired_workers"]
    assert [(s.labels, s.value) for s in desired.samples] == [({"pool": "cpu"}, 1)]
    families = {f.name: f for f in vllm_gauges("m", "cpu", Batcher())}
    waiting = families["vllm:num_requests_waiting"]
    assert [(s.labels, s.value) for s in waiting.samples] == [({"model_name": "m", "pool": "cpu"}, 0)]


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def check_service(objects, c: dict, host: str, port: int, metrics_port: int | None, config_map: str, drain: float,
                  deployment: dict, headless: bool = False) -> None:
    """A service's Deployment and Service agree with its config section."""
    assert ports(c)["grpc"] == port
    if metrics_port is not None:
        assert ports(c)["metrics"] == metrics_port
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(metrics_port)
    service = find(objects, "Service", host)
    assert (service["spec"].get("clusterIP") == "None") == headless
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert by_name["grpc"]["port"] == port and by_name["grpc"]["targetPort"] == "grpc"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert c["readinessProbe"]["grpc"]["port"] == port and c["startupProbe"]["grpc"]["port"] == port
    # Alive while draining: the health service that stays SERVING until the process exits.
    assert c["livenessProbe"]["grpc"] == {"port": port, "service": LIVENESS_SERVICE}
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
    assert "--config" in c["args"] and c["args"][c["args"].index("--config") + 1] == "/etc/qos-serve/cluster.toml"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config_map
    security = c["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"]


def test_the_manifests_agree_with_the_config_they_carry(rendered):
    overlay, objects = rendered
    config, config_map = config_of(objects)
    router = find(objects, "Deployment", "qos-router")
    r = config.router
    check_service(objects, container(router), r.host, r.port, r.metrics_port, config_map, r.drain_seconds, router)
    assert ports(container(router))["http"] == r.http_port
    env = {e["name"]: e for e in container(router)["env"]}
    assert env["QOS_STORE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "qos-store"   # PostgreSQL, not shipped
    assert router["spec"]["replicas"] == config.auth.replicas                         # limits shared by replicas
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    assert deployments == {"qos-router"} | {f"qos-{role}-{p.name}" for p in config.pools for role in ("scheduler", "worker")}
    for pool in config.pools:
        scheduler = find(objects, "Deployment", f"qos-scheduler-{pool.name}")
        s = pool.scheduler
        check_service(objects, container(scheduler), s.host, s.port, s.metrics_port, config_map, s.drain_seconds,
                      scheduler)
        assert container(scheduler)["args"][:3] == ["scheduler", "--config", "/etc/qos-serve/cluster.toml"]
        assert container(scheduler)["args"][3:5] == ["--pool", pool.name]
        # The scheduler finds its workers by resolving their headless Service.
        assert s.workers_from == "dns"
        dns_host, dns_port = s.workers_dns.rsplit(":", 1)
        worker = find(objects, "Deployment", f"qos-worker-{pool.name}")
        (w,) = pool.workers
        assert dns_host == w.host and int(dns_port) == w.port
        c = container(worker)
        check_service(objects, c, dns_host, w.port, w.metrics_port, config_map, w.drain_seconds, worker, headless=True)
        assert c["args"][3:5] == ["--pool", pool.name] and c["image"] == IMAGES[pool.device]
        limits = c["resources"]["limits"]
        assert w.threads <= cpu_cores(limits["cpu"]) and cpu_cores(c["resources"]["requests"]["cpu"]) >= w.threads
        device = {"cuda": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}.get(pool.device)
        assert (device is None and not any("/" in k for k in limits)) or limits.get(device) == 1
        assert worker["metadata"]["labels"]["qos-serve/pool"] == pool.name


def test_the_base_rules_are_generated_from_the_base_config():
    from services.common.config_file import load_config
    from services.control.alert_rules import rules_yaml
    base = ROOT / "deploy" / "kubernetes" / "base"
    assert (base / "prometheusrule.yaml").read_text() == rules_yaml(load_config(base / "cluster.toml"), kubernetes=True), \
        "regenerate: qos-serve alerts --rules --kubernetes --config deploy/kubernetes/base/cluster.toml"
