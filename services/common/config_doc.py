"""docs/configuration.md, generated from the config dataclasses' setting() fields (config.py), so
that the manual and the code cannot differ (tests/unit/test_config_doc.py compares them).

    python -m services.common.config_doc > docs/configuration.md
"""
from __future__ import annotations

import json
from dataclasses import MISSING, Field, fields

from services.common.batch_config import BatchConfig
from services.common.responses_config import ResponsesConfig
from services.common.config import (AdapterConfig, AlertsConfig, AuthConfig, AutoscaleConfig, BillingConfig,
                                    ClusterConfig, PoolConfig, RouterConfig, SchedulerConfig, SecurityConfig,
                                    SlaConfig, StoreConfig, WorkerConfig)

# (table as a config file writes it, its dataclass, a line on what it is)
TABLES = [
    ("(top level)", ClusterConfig, "The model every pool serves, and how a local cluster places its processes."),
    ("[router]", RouterConfig, "The router: the gRPC and HTTP fronts, pool choice, TLS."),
    ("[[pools]]", PoolConfig, "A pool: one scheduler and its workers on one kind of device. A file with one "
                              "pool may give its `[scheduler]`, `[[workers]]`, `[autoscale]` and `[[adapters]]` "
                              "at the top level instead."),
    ("[pools.scheduler]", SchedulerConfig, "The pool's scheduler: fair queueing, KV caps, batching, workers."),
    ("[[pools.workers]]", WorkerConfig, "One worker of the pool."),
    ("[pools.autoscale]", AutoscaleConfig, "When the pool wants a worker more or fewer."),
    ("[[pools.adapters]]", AdapterConfig, "A LoRA adapter the pool's workers load at start."),
    ("[store]", StoreConfig, "The tenant and billing database."),
    ("[auth]", AuthConfig, "API keys."),
    ("[security]", SecurityConfig, "Trust inside the cluster: who may call a scheduler or a worker "
                                   "(docs/security.md)."),
    ("[billing]", BillingConfig, "Prices."),
    ("[[sla]]", SlaConfig, "An SLA contract, judged over a rolling window (default: High TTFT P99 <= 200 ms, "
                           "success >= 99.9%). An empty list turns SLA alerts off."),
    ("[alerts]", AlertsConfig, "Where alerts go."),
    ("[batches]", BatchConfig, "OpenAI's Batch API, run by the routers."),
    ("[responses]", ResponsesConfig, "What the routers keep of OpenAI Responses API answers."),
]


def keys(cls) -> list[Field]:
    """The fields of `cls` a file sets as keys (not the nested tables), in declaration order."""
    return [f for f in fields(cls) if f.metadata]


def default_of(f: Field) -> str:
    value = f.default if f.default is not MISSING else f.default_factory()
    return "unset" if value is None else json.dumps(value)


def values_of(f: Field) -> str:
    meta = f.metadata
    kind = meta["kind"]
    if meta["per_class"] and meta["choices"]:
        text = "high, medium, low: each " + " or ".join(f"`{c}`" for c in meta["choices"])
    elif meta["per_class"]:
        element = "integers" if kind is int else "numbers"
        text = f"high, medium, low: {element}" + (f" {meta['bounds']}" if meta["bounds"] else "")
    elif meta["choices"]:
        text = ", ".join(f"`{c}`" for c in meta["choices"])
    else:
        name = {bool: "true / false", int: "integer", float: "number", str: "string", list: "list"}.get(kind, "")
        text = name + (f" {meta['bounds']}" if meta["bounds"] else "")
    return "; ".join(part for part in (text, meta["note"]) if part)


def render() -> str:
    lines = ["# Configuration", "",
             "One file, TOML (or JSON of the same shape), configures every service of a cluster: "
             "`qos-serve up --config FILE`, and each service started on its own with `--config FILE`. "
             "Every key is optional; an unknown key, a value of the wrong type or out of range is refused "
             "at start with a message that names the key. `configs/` has examples.", "",
             "This page is generated from the code (`python -m services.common.config_doc`); a test fails "
             "when the two differ.", ""]
    total = 0
    for table, cls, what in TABLES:
        rows = keys(cls)
        total += len(rows)
        lines += [f"## {table}", "", what, "", "| key | default | values | meaning |", "|---|---|---|---|"]
        lines += [f"| `{f.name}` | `{default_of(f)}` | {values_of(f)} | {f.metadata['doc']} |" for f in rows]
        lines.append("")
    lines.append(f"{total} keys in all.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
