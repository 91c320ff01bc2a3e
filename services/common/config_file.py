"""Reading a cluster config file (TOML, or JSON of the same shape) into services/common/config.py's
dataclasses, checking every key: unknown keys, wrong types and out-of-range values are refused
with a ConfigError that names the key."""
from __future__ import annotations

import json
import tomllib
from dataclasses import fields
from pathlib import Path

from services.common.config import (
    CPU_BINDINGS,
    DECODE_ATTENTION,
    FIRST_TOKEN_MODES,
    KV_CAP_MODES,
    POLICIES,
    ROUTING_MODES,
    SCHEDULER_LINKS,
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
    ServiceConfig,
    SlaConfig,
    StoreConfig,
    WorkerConfig,
    default_slas,
)
from services.common.cpu_binding import MAX_NICE
from services.common.priority import LABELS, MAX_STREAM_INTERVAL


def check_first_token_hold(value, where: str) -> None:
    """first_token_hold_ms (router and scheduler): ms, 0 (off) to 1,000."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1000):
        raise ConfigError(f"{where}.first_token_hold_ms must be a number of ms in 0..1000 (0: off), got {value!r}")


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
    cores = s.cpu_cores
    if not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 4096 for c in cores) \
            or len(set(cores)) != len(cores):
        raise ConfigError(f"{where}.cpu_cores must be distinct CPU numbers (0, 1, ...; [] = unbound), got {cores!r}")
    if isinstance(s.nice, bool) or not isinstance(s.nice, int) or not 0 <= s.nice <= MAX_NICE:
        raise ConfigError(f"{where}.nice must be an increment in 0..{MAX_NICE} (lowering a nice value needs "
                          f"privileges), got {s.nice!r}")


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
    if s.kv_cap_mode not in KV_CAP_MODES:
        raise ConfigError(f"{where}.kv_cap_mode must be one of {', '.join(KV_CAP_MODES)}, got {s.kv_cap_mode!r}")
    if not (isinstance(s.high_step_ms, (int, float)) and s.high_step_ms >= 0):
        raise ConfigError(f"{where}.high_step_ms must be a number >= 0 (0: off), got {s.high_step_ms!r}")
    if not isinstance(s.high_cut_in, bool):
        raise ConfigError(f"{where}.high_cut_in must be true or false, got {s.high_cut_in!r}")
    if not (isinstance(s.high_cut_in_slots, (int, float)) and not isinstance(s.high_cut_in_slots, bool)
            and 0 <= s.high_cut_in_slots <= 1):
        raise ConfigError(f"{where}.high_cut_in_slots must be a share of max_running in 0..1 (0: none beyond it), "
                          f"got {s.high_cut_in_slots!r}")
    if s.high_first_token not in FIRST_TOKEN_MODES:
        raise ConfigError(f"{where}.high_first_token must be one of {', '.join(FIRST_TOKEN_MODES)}, "
                          f"got {s.high_first_token!r}")
    if len(s.stream_intervals) != 3 or not all(isinstance(n, int) and not isinstance(n, bool)
                                               and 1 <= n <= MAX_STREAM_INTERVAL for n in s.stream_intervals):
        raise ConfigError(f"{where}.stream_intervals must be 3 whole numbers of tokens >= 1 (high, medium, low), "
                          f"got {s.stream_intervals}")
    check_first_token_hold(s.first_token_hold_ms, where)
    if not (isinstance(s.stream_max_hold_ms, (int, float)) and 0 <= s.stream_max_hold_ms <= 60_000):
        raise ConfigError(f"{where}.stream_max_hold_ms must be a number of ms in 0..60000, got {s.stream_max_hold_ms!r}")
    if len(s.tokenizer_nice) != 3 or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_NICE
                                             for n in s.tokenizer_nice):
        raise ConfigError(f"{where}.tokenizer_nice must be 3 whole numbers in 0..{MAX_NICE} (high, medium, low), "
                          f"got {s.tokenizer_nice}")
    if len(s.tokenize_inline_chars) != 3 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                    for n in s.tokenize_inline_chars):
        raise ConfigError(f"{where}.tokenize_inline_chars must be 3 whole numbers of characters >= 0 (high, medium, "
                          f"low; 0: always the tokenizer thread), got {s.tokenize_inline_chars}")
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
    if pool.device not in ("cuda", "npu", "cpu"):
        raise ConfigError(f"{where}.device must be cuda, npu or cpu, got {pool.device!r}")
    # A worker that names no device runs on its pool's.
    pool.workers = [_section(WorkerConfig, {"device": pool.device, **w} if isinstance(w, dict) else w,
                             f"{where}.workers[{i}]") for i, w in enumerate(workers)]
    for i, w in enumerate(pool.workers):
        if w.threads < 0:
            raise ConfigError(f"{where}.workers[{i}].threads must be >= 0")
        if not 1 <= w.max_loras <= w.max_cpu_loras:
            raise ConfigError(f"{where}.workers[{i}]: need 1 <= max_loras <= max_cpu_loras, got "
                              f"{w.max_loras} and {w.max_cpu_loras}")
        if len(pool.adapters) > w.max_cpu_loras:
            raise ConfigError(f"{where}.workers[{i}].max_cpu_loras is {w.max_cpu_loras} but the pool lists "
                              f"{len(pool.adapters)} adapters")
        if w.decode_attention not in DECODE_ATTENTION:
            raise ConfigError(f"{where}.workers[{i}].decode_attention must be one of "
                              f"{', '.join(DECODE_ATTENTION)}, got {w.decode_attention!r}")
        if w.kv_cache_mb is not None and (not isinstance(w.kv_cache_mb, int) or w.kv_cache_mb <= 0):
            raise ConfigError(f"{where}.workers[{i}].kv_cache_mb must be a positive integer (MiB)")
        if w.kv_cache_fraction is not None and (not isinstance(w.kv_cache_fraction, (int, float))
                                                or not 0 < w.kv_cache_fraction <= 1):
            raise ConfigError(f"{where}.workers[{i}].kv_cache_fraction must be in (0, 1]")
        # Never label a pool with a device it does not have.
        if w.device.split(":")[0] != pool.device:
            raise ConfigError(f"{where}.workers[{i}].device is {w.device!r} but the pool is {pool.device!r}")
    _check_autoscale(pool, f"{where}.autoscale")
    return pool


def _number(value, where: str, low: float, high: float = float("inf"), strict_low: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        low < value if strict_low else low <= value) and value <= high
    if not ok:
        bound = f"> {low}" if strict_low else f">= {low}"
        raise ConfigError(f"{where} must be a number {bound}" + (f" and <= {high}" if high != float("inf") else "")
                          + f", got {value!r}")


def _check_autoscale(pool: PoolConfig, where: str) -> None:
    a = pool.autoscale
    for name in ("min_workers", "max_workers"):
        value = getattr(a, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{where}.{name} must be an integer >= 1, got {value!r}")
    low, high = pool.worker_limits()
    if a.max_workers is not None and a.max_workers < low:
        raise ConfigError(f"{where}.max_workers ({a.max_workers}) is below min_workers ({low})")
    if low < len(pool.workers):
        raise ConfigError(f"{where}.min_workers ({low}) is below the {len(pool.workers)} configured workers")
    if a.high_ttft_p99_ms is not None:
        _number(a.high_ttft_p99_ms, f"{where}.high_ttft_p99_ms", 0, strict_low=True)
    _number(a.scale_out_high_backlog, f"{where}.scale_out_high_backlog", 1)
    _number(a.kv_high, f"{where}.kv_high", 0, 1, strict_low=True)
    _number(a.scale_in_below, f"{where}.scale_in_below", 0, 1)
    for name in ("kv_high_for_s", "scale_in_after_s", "scale_out_cooldown_s", "scale_in_cooldown_s"):
        _number(getattr(a, name), f"{where}.{name}", 0)


def _parse_sla(raw, where: str) -> SlaConfig:
    sla = _section(SlaConfig, raw, where)
    if sla.priority not in LABELS:
        raise ConfigError(f"{where}.priority must be high, medium or low, got {sla.priority!r}")
    objectives = sla.objectives()
    if not objectives:
        raise ConfigError(f"{where} sets no objective: give ttft_p99_ms, e2e_p99_ms, tpot_p99_ms "
                          "or success_rate")
    for name, value in objectives.items():
        if name == "success_rate":
            _number(value, f"{where}.success_rate", 0, 1, strict_low=True)
        else:
            _number(value, f"{where}.{name}", 0, strict_low=True)
    _number(sla.window_s, f"{where}.window_s", 1, 86400)
    _number(sla.for_seconds, f"{where}.for_seconds", 0, 86400)
    if sla.resolve_seconds is not None:
        _number(sla.resolve_seconds, f"{where}.resolve_seconds", 0, 86400)
    _number(sla.hysteresis, f"{where}.hysteresis", 0, 0.9)
    _number(sla.min_requests, f"{where}.min_requests", 1)
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
    _number(alerts.evaluate_every_s, "alerts.evaluate_every_s", 0.05, 60)
    _number(alerts.webhook_timeout_s, "alerts.webhook_timeout_s", 0, 300, strict_low=True)
    _number(alerts.webhook_retries, "alerts.webhook_retries", 0, 100)
    return slas, alerts


def parse_config(raw: dict) -> ClusterConfig:
    known = {"model", "router", "pools", "scheduler", "workers", "autoscale", "adapters", "store", "auth",
             "billing", "sla", "alerts", "cpu_binding"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]}; known: {', '.join(sorted(known))}")
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
    if router.routing not in ROUTING_MODES:
        raise ConfigError(f"router.routing must be one of {', '.join(ROUTING_MODES)}, got {router.routing!r}")
    if router.admission not in ("priority", "fifo"):
        raise ConfigError(f"router.admission must be priority or fifo, got {router.admission!r}")
    if not -1 <= router.http_port <= 65535:
        raise ConfigError(f"router.http_port must be in 0..65535 (0 = a free port) or -1 (off), "
                          f"got {router.http_port}")
    if not -1 <= router.high_port <= 65535:
        raise ConfigError(f"router.high_port must be in 0..65535 (0 = a free port) or -1 (off), "
                          f"got {router.high_port!r}")
    if router.high_port > 0 and router.high_port in (router.port, router.http_port):
        raise ConfigError(f"router.high_port {router.high_port} is the router's "
                          f"{'gRPC' if router.high_port == router.port else 'HTTP'} port too: give it one of its own")
    if not 0 <= router.migration_limit <= 100:
        raise ConfigError(f"router.migration_limit must be in 0..100, got {router.migration_limit}")
    if router.scheduler_link not in SCHEDULER_LINKS:
        raise ConfigError(f"router.scheduler_link must be one of {', '.join(SCHEDULER_LINKS)}, "
                          f"got {router.scheduler_link!r}")
    check_first_token_hold(router.first_token_hold_ms, "router")
    if not 0 <= router.forward_window <= 1_000_000:
        raise ConfigError(f"router.forward_window must be in 0..1000000 (0 = no window), got {router.forward_window}")
    if router.http_max_body_bytes < 1024:
        raise ConfigError(f"router.http_max_body_bytes must be >= 1024, got {router.http_max_body_bytes}")
    if bool(router.tls_cert) != bool(router.tls_key):
        raise ConfigError("router.tls_cert and router.tls_key go together (PEM files)")
    for name in ("tls_cert", "tls_key"):
        if getattr(router, name) and not Path(getattr(router, name)).expanduser().is_file():
            raise ConfigError(f"router.{name}: no file {getattr(router, name)}")
    store = _section(StoreConfig, raw.get("store", {}), "store")
    auth = _section(AuthConfig, raw.get("auth", {}), "auth")
    if auth.replicas < 1:
        raise ConfigError(f"auth.replicas must be >= 1, got {auth.replicas}")
    billing = _section(BillingConfig, raw.get("billing", {}), "billing")
    if len(billing.multipliers) != 3 or not all(
            isinstance(m, (int, float)) and not isinstance(m, bool) and m >= 0 for m in billing.multipliers):
        raise ConfigError(f"billing.multipliers must be 3 numbers >= 0 (high, medium, low), got "
                          f"{billing.multipliers}")
    if not billing.flush_seconds > 0:
        raise ConfigError(f"billing.flush_seconds must be > 0, got {billing.flush_seconds}")
    slas, alerts = _parse_alerts(raw)
    cpu_binding = raw.get("cpu_binding", "auto")
    if cpu_binding not in CPU_BINDINGS:
        raise ConfigError(f"cpu_binding must be one of {', '.join(CPU_BINDINGS)}, got {cpu_binding!r}")
    return ClusterConfig(model=str(raw.get("model", "default")), router=router, pools=pools,
                         store=store, auth=auth, billing=billing, sla=slas, alerts=alerts, cpu_binding=cpu_binding)


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
