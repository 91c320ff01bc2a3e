"""The cluster configuration: one file (TOML, or JSON with the same shape) for every service.

    model = "default"                 # the embedded SmolLM2-135M-Instruct, or a model folder

    [router]
    port = 50051

    [scheduler]
    port = 50052
    policy = "qos"

    [[workers]]
    port = 50053
    device = "cpu"
    threads = 1
    kv_cache_mb = 256

A port of 0 means "pick a free one" (`qos-serve up` resolves them before starting anything).
Services bind to loopback unless a host is given.
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from services.common.drain import DEFAULT_DRAIN_SECONDS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_CPU_KV_MB = 256
DEFAULT_KV_FRACTION = 0.8
POLICIES = ("qos", "fcfs")


class ConfigError(ValueError):
    """The configuration file is wrong; the message names the key."""


@dataclass(slots=True)
class ServiceConfig:
    """What every service's table has: where it listens, its metrics, how long it drains."""
    host: str = DEFAULT_HOST
    port: int = 0
    metrics_port: int | None = None   # Prometheus /metrics; None = off, 0 = a free port
    # On SIGTERM: requests in flight get this long to finish (new ones are refused meanwhile).
    drain_seconds: float = DEFAULT_DRAIN_SECONDS

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(slots=True)
class RouterConfig(ServiceConfig):
    port: int = 50051
    routing: str = "cost"             # "cost": cost-aware pool choice; "primary": all on the primary
    admission: str = "priority"       # "priority": High first through a burst; "fifo": arrival order
    # The OpenAI-compatible HTTP front (same host): 0 = a free port, -1 = off.
    http_port: int = 8000
    http_max_body_bytes: int = 4 * 2**20    # larger request bodies get 413
    # A request whose pool fails mid-way (its scheduler died, or it has no worker left) moves to
    # another pool that serves the model, with the tokens already streamed: at most this often.
    migration_limit: int = 3

    @property
    def http_address(self) -> str | None:
        return None if self.http_port < 0 else f"{self.host}:{self.http_port}"


@dataclass(slots=True)
class SchedulerConfig(ServiceConfig):
    port: int = 50052
    policy: str = "qos"               # "qos" (fair queueing, caps, preemption) or "fcfs" (baseline)
    weights: list = field(default_factory=lambda: [5.0, 3.0, 2.0])    # High, Medium, Low tokens
    kv_caps: list = field(default_factory=lambda: [1.0, 0.7, 0.3])    # share of each worker's KV
    max_running: int = 64             # sequences holding KV blocks at once, per worker
    max_step_tokens: int = 512        # tokens per engine step: bounds step time (chunked prefill)
    max_queue: int = 1024             # waiting requests per class before RESOURCE_EXHAUSTED
    retry_after_ms: int = 1000        # advice sent with RESOURCE_EXHAUSTED for a full queue
    # Where the pool's workers come from: "config" (dial the [[pools.workers]] addresses), "dns"
    # (every address workers_dns resolves to, re-resolved every workers_dns_interval_s: a
    # Kubernetes headless Service), or "join" (only workers that register: `qos-serve worker
    # --join`). Workers may register in every mode; [[pools.workers]] stays their settings.
    workers_from: str = "config"
    workers_dns: str = ""             # "qos-workers.ns.svc.cluster.local:50053"
    workers_dns_interval_s: float = 5.0
    # With no worker to serve (all failed or left), how long requests wait for one to (re)join
    # before they are handed back to the router (UNAVAILABLE) to be moved to another pool.
    orphan_grace_s: float = 10.0
    step_timeout_s: float = 120.0     # a worker slower than this to answer one step counts as gone


@dataclass(slots=True)
class WorkerConfig(ServiceConfig):
    port: int = 50053
    device: str = "cpu"
    dtype: str | None = None          # default: fp32 on CPU, bf16 on CUDA, fp16 on NPU
    threads: int = 1                  # torch CPU threads, set explicitly in every worker
    kv_cache_mb: int | None = None    # KV budget in MiB; unset: 256 on CPU, else by fraction
    kv_cache_fraction: float | None = None  # of free memory after the weights; unset: 0.8 on GPU/NPU
    block_size: int = 16

    def kv_budget(self) -> tuple[int | None, float]:
        """(explicit KV bytes or None, share of free memory used when there are none). An
        accelerator's memory is there for the KV cache, so it takes most of what the weights leave;
        a CPU worker shares RAM with everything else, so it takes a fixed budget."""
        fraction = self.kv_cache_fraction if self.kv_cache_fraction is not None else DEFAULT_KV_FRACTION
        if self.kv_cache_mb is not None:
            return self.kv_cache_mb * 2**20, fraction
        if self.kv_cache_fraction is None and self.device.startswith("cpu"):
            return DEFAULT_CPU_KV_MB * 2**20, fraction
        return None, fraction


@dataclass(slots=True)
class PoolConfig:
    """A pool: one scheduler and its workers, all on one kind of device."""
    name: str = "cpu"                 # reported as `pool` in every response
    device: str = "cpu"               # cuda | npu | cpu: what the pool's workers run on
    cost_per_token: float | None = None   # default by device: cuda 1.0, npu 0.3, cpu 0.1
    primary: bool = False             # takes High when there is no GPU pool
    lora: bool = False                # can serve requests naming a LoRA adapter
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workers: list[WorkerConfig] = field(default_factory=lambda: [WorkerConfig()])


@dataclass(slots=True)
class ClusterConfig:
    model: str = "default"
    router: RouterConfig = field(default_factory=RouterConfig)
    pools: list[PoolConfig] = field(default_factory=lambda: [PoolConfig()])

    def pool(self, name: str | None) -> PoolConfig:
        """The named pool, or the first one."""
        if name is None:
            return self.pools[0]
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise ConfigError(f"no pool named {name!r}; pools: {', '.join(p.name for p in self.pools)}")

    def to_dict(self) -> dict:
        return asdict(self)

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2))


def single_pool(router: RouterConfig | None = None, scheduler: SchedulerConfig | None = None,
                workers: list[WorkerConfig] | None = None, model: str = "default",
                name: str = "cpu") -> ClusterConfig:
    """A one-pool cluster (what the top-level [scheduler] and [[workers]] tables describe)."""
    return ClusterConfig(model=model, router=router or RouterConfig(), pools=[PoolConfig(
        name=name, primary=True, scheduler=scheduler or SchedulerConfig(),
        workers=workers or [WorkerConfig()])])


def _section(cls, raw: dict, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"unknown key {where}.{unknown[0]}; known: {', '.join(known)}")
    defaults = cls()
    for name, value in raw.items():
        default = getattr(defaults, name)
        if default is None or value is None:
            continue
        # TOML's true is an int to Python: a flag where a number belongs is still the wrong type.
        wrong_bool = isinstance(value, bool) and not isinstance(default, bool)
        if wrong_bool or not (isinstance(value, type(default))
                              or (isinstance(default, float) and isinstance(value, int))):
            raise ConfigError(f"{where}.{name} must be {type(default).__name__}, got {value!r}")
    obj = cls(**raw)
    if isinstance(obj, ServiceConfig):
        _check_service(obj, where)
    return obj


def _check_service(s: ServiceConfig, where: str) -> None:
    if not 0 <= s.port <= 65535:
        raise ConfigError(f"{where}.port must be in 0..65535, got {s.port}")
    if s.metrics_port is not None and (isinstance(s.metrics_port, bool) or not isinstance(s.metrics_port, int)
                                       or not 0 <= s.metrics_port <= 65535):
        raise ConfigError(f"{where}.metrics_port must be a port in 0..65535 (0 = a free one), "
                          f"got {s.metrics_port!r}")
    if not 0 <= s.drain_seconds <= 3600:
        raise ConfigError(f"{where}.drain_seconds must be in 0..3600, got {s.drain_seconds}")


def _check_scheduler(s: SchedulerConfig, where: str) -> None:
    if s.policy not in POLICIES:
        raise ConfigError(f"{where}.policy must be one of {', '.join(POLICIES)}, got {s.policy!r}")
    if len(s.weights) != 3 or not all(isinstance(w, (int, float)) and w > 0 for w in s.weights):
        raise ConfigError(f"{where}.weights must be 3 numbers > 0 (high, medium, low), got {s.weights}")
    if len(s.kv_caps) != 3 or not all(isinstance(c, (int, float)) and 0 < c <= 1 for c in s.kv_caps):
        raise ConfigError(f"{where}.kv_caps must be 3 shares in (0, 1] (high, medium, low), got {s.kv_caps}")
    if s.max_running < 1 or s.max_step_tokens < s.max_running:
        raise ConfigError(f"need {where}.max_running >= 1 and max_step_tokens >= max_running")
    if s.max_queue < 1:
        raise ConfigError(f"{where}.max_queue must be >= 1, got {s.max_queue}")
    if s.retry_after_ms < 1:
        raise ConfigError(f"{where}.retry_after_ms must be >= 1, got {s.retry_after_ms}")
    if s.workers_from not in ("config", "dns", "join"):
        raise ConfigError(f"{where}.workers_from must be config, dns or join, got {s.workers_from!r}")
    host, _, port = s.workers_dns.rpartition(":")
    if s.workers_from == "dns" and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"{where}.workers_dns must be HOST:PORT with workers_from = \"dns\", "
                          f"got {s.workers_dns!r}")
    for name in ("workers_dns_interval_s", "orphan_grace_s", "step_timeout_s"):
        if not getattr(s, name) > 0:
            raise ConfigError(f"{where}.{name} must be > 0, got {getattr(s, name)}")


def _parse_pool(raw: dict, where: str) -> PoolConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table")
    flat = {k: v for k, v in raw.items() if k not in ("scheduler", "workers")}
    pool = _section(PoolConfig, flat, where)
    pool.scheduler = _section(SchedulerConfig, raw.get("scheduler", {}), f"{where}.scheduler")
    _check_scheduler(pool.scheduler, f"{where}.scheduler")
    workers = raw.get("workers", [{}])
    if not isinstance(workers, list) or not workers:
        raise ConfigError(f"{where}.workers must be a non-empty list of worker tables")
    if pool.device not in ("cuda", "npu", "cpu"):
        raise ConfigError(f"{where}.device must be cuda, npu or cpu, got {pool.device!r}")
    # A worker that names no device runs on its pool's.
    pool.workers = [_section(WorkerConfig, {"device": pool.device, **w} if isinstance(w, dict) else w,
                             f"{where}.workers[{i}]") for i, w in enumerate(workers)]
    for i, w in enumerate(pool.workers):
        if w.threads < 0:
            raise ConfigError(f"{where}.workers[{i}].threads must be >= 0")
        if w.kv_cache_mb is not None and (not isinstance(w.kv_cache_mb, int) or w.kv_cache_mb <= 0):
            raise ConfigError(f"{where}.workers[{i}].kv_cache_mb must be a positive integer (MiB)")
        if w.kv_cache_fraction is not None and (not isinstance(w.kv_cache_fraction, (int, float))
                                                or not 0 < w.kv_cache_fraction <= 1):
            raise ConfigError(f"{where}.workers[{i}].kv_cache_fraction must be in (0, 1]")
        # Never label a pool with a device it does not have.
        if w.device.split(":")[0] != pool.device:
            raise ConfigError(f"{where}.workers[{i}].device is {w.device!r} but the pool is {pool.device!r}")
    return pool


def parse_config(raw: dict) -> ClusterConfig:
    known = {"model", "router", "pools", "scheduler", "workers"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]}; known: {', '.join(sorted(known))}")
    if "pools" in raw and ("scheduler" in raw or "workers" in raw):
        raise ConfigError("give either [[pools]] or a single pool's [scheduler] and [[workers]], not both")
    if "pools" in raw:
        if not isinstance(raw["pools"], list) or not raw["pools"]:
            raise ConfigError("pools must be a non-empty list of [[pools]] tables")
        pools = [_parse_pool(p, f"pools[{i}]") for i, p in enumerate(raw["pools"])]
    else:
        single = {"name": "cpu", "primary": True, "scheduler": raw.get("scheduler", {}),
                  "workers": raw.get("workers", [{}])}
        pools = [_parse_pool(single, "pool")]
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ConfigError(f"pool names must be unique, got {names}")
    router = _section(RouterConfig, raw.get("router", {}), "router")
    if router.routing not in ("cost", "primary"):
        raise ConfigError(f"router.routing must be cost or primary, got {router.routing!r}")
    if router.admission not in ("priority", "fifo"):
        raise ConfigError(f"router.admission must be priority or fifo, got {router.admission!r}")
    if not -1 <= router.http_port <= 65535:
        raise ConfigError(f"router.http_port must be in 0..65535 (0 = a free port) or -1 (off), "
                          f"got {router.http_port}")
    if not 0 <= router.migration_limit <= 100:
        raise ConfigError(f"router.migration_limit must be in 0..100, got {router.migration_limit}")
    if router.http_max_body_bytes < 1024:
        raise ConfigError(f"router.http_max_body_bytes must be >= 1024, got {router.http_max_body_bytes}")
    return ClusterConfig(model=str(raw.get("model", "default")), router=router, pools=pools)


def load_config(path: str | Path | None) -> ClusterConfig:
    if path is None:
        return ClusterConfig()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return parse_config(raw)
