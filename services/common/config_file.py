"""Reading a cluster config file (TOML, or JSON of the same shape) into services/common/config.py's
dataclasses, checking every key: unknown keys, wrong types and out-of-range values are refused
with a ConfigError that names the key."""
from __future__ import annotations

import json
import tomllib
from dataclasses import fields
from pathlib import Path

from services.common.batch_config import BatchConfig
from services.common.responses_config import ResponsesConfig
from services.common.config import (
    AdapterConfig,
    AlertsConfig,
    AuthConfig,
    AutoscaleConfig,
    BillingConfig,
    ClusterConfig,
    ConfigError,
    PoolConfig,
    RouterConfig,
    SchedulerConfig,
    SecurityConfig,
    SlaConfig,
    StoreConfig,
    WorkerConfig,
    default_slas,
)


def _section(cls, raw: dict, where: str):
    """A table read into `cls`, every key checked against its field's setting() (config.py)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"unknown key {where + '.' if where else ''}{unknown[0]}; known: {', '.join(known)}")
    for name, value in raw.items():
        if value is not None and known[name].metadata:
            check_value(known[name].metadata, value, f"{where}.{name}" if where else name)
    return cls(**raw)


def _is(value, kind: type) -> bool:
    # TOML's true is an int to Python: a flag where a number belongs is still the wrong type.
    if isinstance(value, bool) and kind is not bool:
        return False
    return isinstance(value, kind) or (kind is float and isinstance(value, int))


def check_value(meta, value, key: str) -> None:
    """`value` against a key's setting(): its type, its choices, its bounds (each of three, per class)."""
    kind, bounds, choices = meta["kind"], meta["bounds"], meta["choices"]
    if meta["per_class"] and choices:
        if not (isinstance(value, list) and len(value) == 3 and all(v in choices for v in value)):
            raise ConfigError(f"{key} must be 3 of {', '.join(choices)} (high, medium, low), got {value!r}")
        return
    if meta["per_class"]:
        element = kind if kind in (int, float) else float
        if not (isinstance(value, list) and len(value) == 3 and all(_is(v, element) for v in value)
                and (bounds is None or all(bounds.admits(v) for v in value))):
            what = "whole numbers" if element is int else "numbers"
            raise ConfigError(f"{key} must be 3 {what} (high, medium, low)"
                              + (f", each {bounds}" if bounds else "") + f", got {value!r}")
        return
    if kind is not None and not _is(value, kind):
        raise ConfigError(f"{key} must be {kind.__name__}, got {value!r}")
    if choices and value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
    if bounds is not None and not bounds.admits(value):
        raise ConfigError(f"{key} must be {bounds}, got {value!r}")


def _check_scheduler(s: SchedulerConfig, where: str) -> None:
    if s.max_step_tokens < s.max_running:
        raise ConfigError(f"need {where}.max_step_tokens >= max_running, got {s.max_step_tokens} < {s.max_running}")
    host, _, port = s.workers_dns.rpartition(":")
    if s.workers_from == "dns" and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"{where}.workers_dns must be HOST:PORT with workers_from = \"dns\", "
                          f"got {s.workers_dns!r}")


def _check_worker(w: WorkerConfig, pool: PoolConfig, where: str) -> None:
    if w.max_loras > w.max_cpu_loras:
        raise ConfigError(f"{where}: need max_loras <= max_cpu_loras, got {w.max_loras} and {w.max_cpu_loras}")
    if w.adapter_dirs is not None and not all(isinstance(d, str) and d for d in w.adapter_dirs):
        raise ConfigError(f"{where}.adapter_dirs must be a list of folders, got {w.adapter_dirs!r}")
    if len(pool.adapters) > w.max_cpu_loras:
        raise ConfigError(f"{where}.max_cpu_loras is {w.max_cpu_loras} but the pool lists "
                          f"{len(pool.adapters)} adapters")
    # Never label a pool with a device it does not have.
    if w.device.split(":")[0] != pool.device:
        raise ConfigError(f"{where}.device is {w.device!r} but the pool is {pool.device!r}")


def _parse_pool(raw: dict, where: str) -> PoolConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table")
    flat = {k: v for k, v in raw.items() if k not in ("scheduler", "workers", "autoscale", "adapters")}
    pool = _section(PoolConfig, flat, where)
    adapters = raw.get("adapters", [])
    if not isinstance(adapters, list):
        raise ConfigError(f"{where}.adapters must be a list of [[pools.adapters]] tables")
    pool.adapters = [_section(AdapterConfig, a, f"{where}.adapters[{i}]") for i, a in enumerate(adapters)]
    names = [a.name for a in pool.adapters]
    for i, a in enumerate(pool.adapters):
        if not a.name or not a.path:
            raise ConfigError(f"{where}.adapters[{i}] needs a name and a path (a PEFT adapter folder)")
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}.adapters: names must be unique, got {names}")
    pool.autoscale = _section(AutoscaleConfig, raw.get("autoscale", {}), f"{where}.autoscale")
    pool.scheduler = _section(SchedulerConfig, raw.get("scheduler", {}), f"{where}.scheduler")
    _check_scheduler(pool.scheduler, f"{where}.scheduler")
    workers = raw.get("workers", [{}])
    if not isinstance(workers, list) or not workers:
        raise ConfigError(f"{where}.workers must be a non-empty list of worker tables")
    # A worker that names no device runs on its pool's.
    pool.workers = [_section(WorkerConfig, {"device": pool.device, **w} if isinstance(w, dict) else w,
                             f"{where}.workers[{i}]") for i, w in enumerate(workers)]
    for i, w in enumerate(pool.workers):
        _check_worker(w, pool, f"{where}.workers[{i}]")
    _check_autoscale(pool, f"{where}.autoscale")
    return pool


def _check_autoscale(pool: PoolConfig, where: str) -> None:
    a = pool.autoscale
    low, _ = pool.worker_limits()
    if a.max_workers is not None and a.max_workers < low:
        raise ConfigError(f"{where}.max_workers ({a.max_workers}) is below min_workers ({low})")
    if low < len(pool.workers):
        raise ConfigError(f"{where}.min_workers ({low}) is below the {len(pool.workers)} configured workers")


def _parse_sla(raw, where: str) -> SlaConfig:
    sla = _section(SlaConfig, raw, where)
    if not sla.objectives():
        raise ConfigError(f"{where} sets no objective: give ttft_p99_ms, e2e_p99_ms, tpot_p99_ms "
                          "or success_rate")
    return sla


def _parse_alerts(raw: dict) -> tuple[list[SlaConfig], AlertsConfig]:
    slas = raw.get("sla")
    if slas is None:
        slas = default_slas()
    elif not isinstance(slas, list):
        raise ConfigError("sla must be a list of [[sla]] tables (an empty list: no SLA alerts)")
    else:
        slas = [_parse_sla(s, f"sla[{i}]") for i, s in enumerate(slas)]
    keys = [(s.priority, s.tenant) for s in slas]
    if len(set(keys)) != len(keys):
        raise ConfigError("two [[sla]] tables for the same priority and tenant: merge their objectives")
    alerts = _section(AlertsConfig, raw.get("alerts", {}), "alerts")
    for i, url in enumerate(alerts.webhooks):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"alerts.webhooks[{i}] must be an http:// or https:// URL, got {url!r}")
    return slas, alerts


def _check_router(router: RouterConfig) -> None:
    if bool(router.tls_cert) != bool(router.tls_key):
        raise ConfigError("router.tls_cert and router.tls_key go together (PEM files)")
    for name in ("tls_cert", "tls_key"):
        if getattr(router, name) and not Path(getattr(router, name)).expanduser().is_file():
            raise ConfigError(f"router.{name}: no file {getattr(router, name)}")


TABLES = ("router", "pools", "scheduler", "workers", "autoscale", "adapters", "store", "auth", "security", "billing",
          "sla", "alerts", "batches", "responses")


def parse_config(raw: dict) -> ClusterConfig:
    top = {k: v for k, v in raw.items() if k not in TABLES}
    top_keys = [f.name for f in fields(ClusterConfig) if f.name not in TABLES]
    unknown = sorted(set(top) - set(top_keys))
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]}; known: {', '.join(sorted([*top_keys, *TABLES]))}")
    if "pools" in raw and any(k in raw for k in ("scheduler", "workers", "autoscale", "adapters")):
        raise ConfigError("give either [[pools]] or a single pool's [scheduler], [[workers]] and "
                          "[autoscale], not both")
    if "pools" in raw:
        if not isinstance(raw["pools"], list) or not raw["pools"]:
            raise ConfigError("pools must be a non-empty list of [[pools]] tables")
        pools = [_parse_pool(p, f"pools[{i}]") for i, p in enumerate(raw["pools"])]
    else:
        single = {"name": "cpu", "primary": True, "scheduler": raw.get("scheduler", {}),
                  "workers": raw.get("workers", [{}]), "autoscale": raw.get("autoscale", {}),
                  "adapters": raw.get("adapters", [])}
        pools = [_parse_pool(single, "pool")]
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ConfigError(f"pool names must be unique, got {names}")
    router = _section(RouterConfig, raw.get("router", {}), "router")
    _check_router(router)
    slas, alerts = _parse_alerts(raw)
    cluster = _section(ClusterConfig, top, "")
    cluster.model = str(cluster.model)
    cluster.router, cluster.pools, cluster.sla, cluster.alerts = router, pools, slas, alerts
    cluster.store = _section(StoreConfig, raw.get("store", {}), "store")
    if cluster.store.stale_s <= cluster.store.refresh_s:
        raise ConfigError(f"need store.stale_s > store.refresh_s, got {cluster.store.stale_s} <= "
                          f"{cluster.store.refresh_s}")
    cluster.auth = _section(AuthConfig, raw.get("auth", {}), "auth")
    cluster.security = _section(SecurityConfig, raw.get("security", {}), "security")
    cluster.billing = _section(BillingConfig, raw.get("billing", {}), "billing")
    cluster.batches = _section(BatchConfig, raw.get("batches", {}), "batches")
    cluster.responses = _section(ResponsesConfig, raw.get("responses", {}), "responses")
    return cluster


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
