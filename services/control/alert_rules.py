"""Prometheus alerting rules equivalent to the router's built-in SLA evaluation, made from the
config's [[sla]] contracts (`qos-serve alerts --rules`; deploy/prometheus/alerts.yml is the
default config's, checked by `promtool check rules` and `promtool test rules` in the tests).

Why both: the router judges what it relays itself, so alerts work with no Prometheus at all; with
several router replicas each judges only its own share, while these rules sum every replica's
histograms and judge the whole cluster.

How they match the built-in evaluation:
- latency objectives: P99 from the router's histograms (`qos_ttft_seconds`, `qos_e2e_seconds`,
  `qos_time_per_output_token_seconds`, completed requests, the series with a `pool` label: the
  schedulers export the same names without one) over the contract's window; Prometheus
  interpolates inside a bucket where the router takes the exact nearest-rank value;
- success_rate: the share of `qos_sla_requests_total{outcome="failed"}`, the counter the router
  keeps of exactly what its success rate counts;
- min_requests: the same floor, from the same counters; `for` = for_seconds;
  `keep_firing_for` = resolve_seconds (Prometheus has no margin, only the hold time);
- tenant objectives: the router's own observed value (`qos_sla_observed`), since the histograms
  carry no tenant label (one per tenant would not scale).
"""
from __future__ import annotations

import yaml

from services.common.config import ClusterConfig
from services.control.sla import Objective, objectives_of

HISTOGRAMS = {"ttft_p99_ms": "qos_ttft_seconds", "e2e_p99_ms": "qos_e2e_seconds",
              "tpot_p99_ms": "qos_time_per_output_token_seconds"}
WHAT = {"ttft_p99_ms": "TTFT P99", "e2e_p99_ms": "end-to-end P99", "tpot_p99_ms": "time per output token P99",
        "success_rate": "success rate"}


def _duration(seconds: float) -> str:
    return f"{round(seconds)}s"


def expression(o: Objective) -> str:
    c = o.contract
    window = _duration(c.window_s)
    if o.tenant != "*":
        match = f'priority="{o.priority}",tenant="{o.tenant}",objective="{o.name}"'
        pick, compare = ("min", "<") if o.higher_is_better else ("max", ">")
        return f"{pick} by (priority, tenant, objective) (qos_sla_observed{{{match}}}) {compare} {o.target:g}"
    if o.name == "success_rate":
        counted = f'sum(increase(qos_sla_requests_total{{priority="{o.priority}"}}[{window}]))'
        failed = f'sum(increase(qos_sla_requests_total{{priority="{o.priority}",outcome="failed"}}[{window}]))'
        return f"1 - {failed} / {counted} < {o.target:g}\nand on() {counted} >= {c.min_requests}"
    metric = HISTOGRAMS[o.name]
    select = f'priority="{o.priority}",pool!=""'
    p99 = f"histogram_quantile(0.99, sum by (le) (rate({metric}_bucket{{{select}}}[{window}]))) * 1000"
    return f"{p99} > {o.target:g}\nand on() sum(increase({metric}_count{{{select}}}[{window}])) >= {c.min_requests}"


def rule(o: Objective) -> dict:
    c = o.contract
    unit = "" if o.name == "success_rate" else " ms"
    bound = ">=" if o.higher_is_better else "<="
    who = "" if o.tenant == "*" else f" (tenant {o.tenant})"
    entry = {
        "alert": "QosSlaBreached", "expr": expression(o), "for": _duration(c.for_seconds),
        "keep_firing_for": _duration(c.resolve_seconds if c.resolve_seconds is not None else c.for_seconds),
        "labels": {"severity": "page" if o.priority == "high" else "ticket", **o.labels},
        "annotations": {
            "summary": f"{o.priority.capitalize()}{who} {WHAT[o.name]} breaks its SLA "
                       f"({bound} {o.target:g}{unit} over {_duration(c.window_s)})",
            "observed": "{{ $value | humanize }}", "objective": f"{o.target:g}"}}
    return entry


def rules(config: ClusterConfig) -> dict:
    groups = [{"name": "qos-serve-sla", "rules": [rule(o) for o in objectives_of(config.sla)]}]
    groups.append({"name": "qos-serve-operations", "rules": [
        {"alert": "QosSlaBreachedAtRouter", "expr": "max by (priority, tenant, objective) (qos_sla_breached) == 1",
         "labels": {"severity": "ticket"},
         "annotations": {"summary": "A router judges {{ $labels.priority }} {{ $labels.objective }} "
                                    "(tenant {{ $labels.tenant }}) breached (its own window and hysteresis)"}},
        {"alert": "QosPoolCannotScaleFurther",
         "expr": 'qos_desired_workers >= qos_max_workers and on(pool) qos_max_workers > qos_min_workers\n'
                 'and on(pool) qos_backlog{priority="high"} > 0',
         "for": "5m", "labels": {"severity": "ticket"},
         "annotations": {"summary": "Pool {{ $labels.pool }} wants its maximum of workers and High still "
                                    "waits: raise [pools.autoscale] max_workers or add capacity"}}]})
    return {"groups": groups}


class _Literal(str):
    pass


def _literal(dumper, text):
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


def rules_yaml(config: ClusterConfig, kubernetes: bool = False) -> str:
    """The rules file; with `kubernetes`, as a Prometheus Operator PrometheusRule object."""
    yaml.SafeDumper.add_representer(_Literal, _literal)
    document = rules(config)
    for group in document["groups"]:
        for entry in group["rules"]:
            entry["expr"] = _Literal(entry["expr"])
    flag = " --kubernetes" if kubernetes else ""
    header = (f"# Generated by `qos-serve alerts --rules{flag}` from the config's [[sla]] contracts\n"
              "# (services/control/alert_rules.py says how they match the router's own evaluation).\n")
    if kubernetes:
        document = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                    "metadata": {"name": "qos-serve-sla", "labels": {"app.kubernetes.io/name": "qos-serve"}},
                    "spec": document}
    return header + yaml.safe_dump(document, sort_keys=False, width=120)
